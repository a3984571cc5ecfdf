"""Stored responses for ``previous_response_id`` and ``GET /v1/responses/{id}``: in memory, bounded.

An LRU bounded twice: at most ``max_responses`` entries (``pagedllm serve --responses-store-size``)
and at most ``max_bytes`` of them (``--responses-store-max-bytes``), an entry's size being the
length of its JSON in UTF-8 (the response plus its conversation). Storing one more evicts the least recently
stored or read until both bounds hold; a response larger than ``max_bytes`` alone is not stored,
and its id is remembered (a bounded set) so that asking for it says why. Nothing survives a
restart; a response created with ``store: false`` is never kept.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.defaults import DEFAULT_RESPONSES_STORE_BYTES, DEFAULT_RESPONSES_STORE_SIZE

# Ids of responses too large to store, remembered for a clear 404 (ids only: a few dozen bytes each).
_MAX_REFUSED_IDS = 1024


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as it was returned
    items: list[dict[str, Any]]  # the conversation: every input item (previous turns included), then the output items

    def size(self) -> int:
        """The entry's accounted size: its JSON's length in UTF-8 bytes.

        Earlier turns shared with the entry of a previous response are counted in each entry that
        holds them: an overcount, so the bound holds however entries share."""
        return sum(len(json.dumps(part, ensure_ascii=False).encode()) for part in (self.response, self.items))


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_RESPONSES_STORE_SIZE,
                 max_bytes: int = DEFAULT_RESPONSES_STORE_BYTES) -> None:
        if max_responses < 0:
            raise ValueError(f"the responses store size must be at least 0, got {max_responses}.")
        if max_bytes < 0:
            raise ValueError(f"the responses store's byte limit must be at least 0, got {max_bytes}.")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._too_large: OrderedDict[str, int] = OrderedDict()  # id -> its size

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Store ``entry`` (evicting the least recently used as needed); False if it is not kept."""
        if self.max_responses == 0 or self.max_bytes == 0:
            return False
        size = entry.size()
        if size > self.max_bytes:
            self._too_large[response_id] = size
            while len(self._too_large) > _MAX_REFUSED_IDS:
                self._too_large.popitem(last=False)
            return False
        self.delete(response_id)
        self._entries[response_id] = (entry, size)
        self.num_bytes += size
        while len(self._entries) > self.max_responses or self.num_bytes > self.max_bytes:
            _, (_, evicted_size) = self._entries.popitem(last=False)
            self.num_bytes -= evicted_size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        found = self._entries.get(response_id)
        if found is None:
            return None
        self._entries.move_to_end(response_id)
        return found[0]

    def delete(self, response_id: str) -> bool:
        found = self._entries.pop(response_id, None)
        if found is None:
            return False
        self.num_bytes -= found[1]
        return True

    def refused_size(self, response_id: str) -> int | None:
        """The size of a response that was too large to store, if ``response_id`` is one (recently)."""
        return self._too_large.get(response_id)
