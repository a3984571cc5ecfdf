"""Stored responses for ``previous_response_id`` and ``GET /v1/responses/{id}``: in memory, bounded.

An LRU of at most ``max_responses`` entries (``pagedllm serve --responses-store-size``): storing one
more evicts the least recently stored or read. Nothing survives a restart; a response created with
``store: false`` is never kept.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.defaults import DEFAULT_RESPONSES_STORE_SIZE


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as it was returned
    items: list[dict[str, Any]]  # the conversation: every input item (previous turns included), then the output items


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_RESPONSES_STORE_SIZE) -> None:
        if max_responses < 0:
            raise ValueError(f"the responses store size must be at least 0, got {max_responses}.")
        self.max_responses = max_responses
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.max_responses == 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_responses:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
