"""A grammar that starts after a token sequence: structured outputs for reasoning models.

A reasoning model thinks freely, then answers; the answer alone must follow the constraint
(vLLM applies the grammar once its reasoning parser says ``is_reasoning_end``). The gate stands in
for the xgrammar matcher everywhere the engine uses one (accept, fill a bitmask row, roll back,
fork, is_terminated): until the output has generated the start sequence it allows every token;
from the token after it on, the inner matcher decides. Rolling back across the start sequence
closes the gate again, so speculative decoding's per-draft masks hold on both sides of it.

With an ``optional_open_token_id`` the free part is optional (a model that may or may not open
``<think>``): the first token is either that token, which opens the free part, or one the grammar
allows, which starts the grammar at once.
"""

from __future__ import annotations

from typing import Any

import torch


def _bit(token_id: int) -> tuple[int, int]:
    """(word, int32 value) of a token's bit in a bitmask row."""
    value = 1 << (token_id % 32)
    return token_id // 32, value - (1 << 32) if value >= 1 << 31 else value


class GatedMatcher:
    def __init__(
        self, matcher: Any, start_after_token_ids: list[int], optional_open_token_id: int | None = None
    ) -> None:
        if not start_after_token_ids:
            raise ValueError("a gated grammar needs a non-empty start sequence")
        self.matcher = matcher
        self.start_after_token_ids = list(start_after_token_ids)
        self.optional_open_token_id = optional_open_token_id
        self.free_token_ids: list[int] = []  # the output before the grammar started (the reasoning)
        self.started = False
        self.started_at_once = False  # the first token was the grammar's (no free part)
        self.num_constrained = 0  # tokens the inner matcher accepted since it started

    @property
    def undecided(self) -> bool:
        """No token yet, and the free part is optional: the first token decides."""
        return self.optional_open_token_id is not None and not self.started and not self.free_token_ids

    def accept_token(self, token_id: int) -> bool:
        if self.undecided and token_id != self.optional_open_token_id:
            self.started = self.started_at_once = True
        if self.started:
            accepted = self.matcher.accept_token(token_id)
            self.num_constrained += bool(accepted)
            if not accepted and self.started_at_once and self.num_constrained == 0:
                self.started = self.started_at_once = False  # refused as the first token: still undecided
            return accepted
        self.free_token_ids.append(token_id)
        start = self.start_after_token_ids
        self.started = self.free_token_ids[-len(start) :] == start
        return True

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        if self.started:
            self.matcher.fill_next_token_bitmask(bitmask, index)
        elif self.undecided:  # the grammar's first tokens, or the one that opens the free part
            self.matcher.fill_next_token_bitmask(bitmask, index)
            word, value = _bit(self.optional_open_token_id)  # type: ignore[arg-type]
            if word < bitmask.shape[1]:
                bitmask[index, word] |= value
        else:
            bitmask[index].fill_(-1)  # every token allowed

    def rollback(self, num_tokens: int) -> None:
        constrained = min(num_tokens, self.num_constrained)
        if constrained:
            self.matcher.rollback(constrained)
            self.num_constrained -= constrained
        free = num_tokens - constrained
        if self.started_at_once and self.num_constrained == 0:
            self.started = self.started_at_once = False  # back before the first token: undecided again
        if free:
            if free > len(self.free_token_ids):
                accepted = len(self.free_token_ids) + constrained
                raise ValueError(f"cannot roll back {num_tokens} tokens: only {accepted} were accepted")
            del self.free_token_ids[-free:]
            self.started = False  # the start sequence ended at the last free token, now gone

    def is_terminated(self) -> bool:
        return self.started and self.matcher.is_terminated()

    def fork(self) -> GatedMatcher:
        child = GatedMatcher(self.matcher.fork(), self.start_after_token_ids, self.optional_open_token_id)
        child.free_token_ids = list(self.free_token_ids)
        child.started = self.started
        child.started_at_once = self.started_at_once
        child.num_constrained = self.num_constrained
        return child
