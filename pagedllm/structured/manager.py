"""The engine's side of structured outputs: matchers for new sequences and each step's token bitmasks."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from pagedllm.sampling_params import StructuredOutputsParams


class StructuredOutputManager:
    """Built lazily on the first constrained request (reading the vocabulary takes a moment)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None
        # Time spent filling bitmasks, and how many steps and rows did so (the benchmark reports it).
        self.fill_seconds = 0.0
        self.num_fill_steps = 0
        self.num_fill_rows = 0
        self._lock = threading.Lock()

    @property
    def compiler(self) -> Any:
        with self._lock:  # the server compiles from worker threads
            if self._compiler is None:
                from pagedllm.structured.grammar import GrammarCompiler

                self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
            return self._compiler

    def new_matcher(self, spec: StructuredOutputsParams) -> Any:
        """A matcher at the grammar's start; raises InvalidRequestError when the constraint cannot compile.

        With ``spec.start_after_token_ids`` the matcher is gated: free until the output generated them
        (or, with ``spec.optional_open_token_id``, unless the output does not begin with that token)."""
        matcher = self.compiler.matcher(spec)
        if spec.start_after_token_ids:
            from pagedllm.structured.gated import GatedMatcher

            return GatedMatcher(matcher, spec.start_after_token_ids, spec.optional_open_token_id)
        return matcher

    def fill_bitmasks(
        self, matchers: list[Any], drafts: list[list[int]] | None = None
    ) -> tuple[torch.Tensor, list[bool], dict[int, BaseException]]:
        """One step's ``[rows, ceil(V / 32)]`` int32 bitmasks of the tokens the matchers allow next,
        filled for the whole batch at once (one allocation, one reduction); per row whether any token
        is allowed at all; and the matchers, by index, that raised (one request's broken matcher must
        not fail the others).

        Without ``drafts`` row i is matcher i's. With them (speculative decoding: per matcher the
        drafts its grammar accepted when they were proposed, possibly none), matcher i has
        ``1 + len(drafts[i])`` consecutive rows, the j-th masking the verification row that follows
        ``drafts[i][:j]``: its grammar's state after those drafts. Each matcher accepts its drafts
        one at a time between its fills and is rolled back after, so it ends as it began and
        verification appends the real tokens from the sequence's own state.
        """
        import xgrammar as xgr

        start = time.perf_counter()
        counts = [1] * len(matchers) if drafts is None else [1 + len(tokens) for tokens in drafts]
        bitmask = xgr.allocate_token_bitmask(sum(counts), self.vocab_size)
        failed: dict[int, BaseException] = {}
        row = 0
        for index, matcher in enumerate(matchers):
            try:
                if counts[index] == 1:
                    matcher.fill_next_token_bitmask(bitmask, row)
                else:
                    _fill_draft_rows(matcher, drafts[index], bitmask, row)  # type: ignore[index]
            except Exception as exc:  # noqa: BLE001 - the engine fails that row's request alone
                failed[index] = exc
            row += counts[index]
        alive = bitmask.ne(0).any(dim=1).tolist()
        self.fill_seconds += time.perf_counter() - start
        self.num_fill_rows += len(alive)
        self.num_fill_steps += 1
        return bitmask, alive, failed

    def stats(self) -> dict[str, float | int]:
        compiler = self._compiler
        return {
            "grammar_mask_seconds": self.fill_seconds,
            "grammar_mask_steps": self.num_fill_steps,
            "grammar_mask_rows": self.num_fill_rows,
            "grammar_cache_hits": compiler.cache_hits if compiler is not None else 0,
            "grammar_cache_misses": compiler.cache_misses if compiler is not None else 0,
        }


def _fill_draft_rows(matcher: Any, drafts: list[int], bitmask: torch.Tensor, row: int) -> None:
    """Fill rows ``row .. row + len(drafts)`` with the matcher's masks before and after each draft,
    then roll the drafts back (also when a fill raises: the matcher must stay the sequence's)."""
    accepted = 0
    try:
        for j, token in enumerate(drafts):
            matcher.fill_next_token_bitmask(bitmask, row + j)
            if not matcher.accept_token(token):
                # The speculator proposes only drafts the grammar accepts: a refusal here is a bug.
                raise ValueError(f"draft token {token} is outside the sequence's structured-output grammar")
            accepted += 1
        matcher.fill_next_token_bitmask(bitmask, row + len(drafts))
    finally:
        if accepted:
            matcher.rollback(accepted)
