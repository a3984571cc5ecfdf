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
        """A matcher at the grammar's start; raises InvalidRequestError when the constraint cannot compile."""
        return self.compiler.matcher(spec)

    def fill_bitmasks(self, matchers: list[Any]) -> tuple[torch.Tensor, list[bool], dict[int, BaseException]]:
        """One step's ``[len(matchers), ceil(V / 32)]`` int32 bitmasks of the tokens each matcher allows
        next, filled for the whole batch at once; per row whether any token is allowed at all; and the
        rows whose matcher raised (one request's broken matcher must not fail the others)."""
        import xgrammar as xgr

        start = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        failed: dict[int, BaseException] = {}
        for index, matcher in enumerate(matchers):
            try:
                matcher.fill_next_token_bitmask(bitmask, index)
            except Exception as exc:  # noqa: BLE001 - the engine fails that row's request alone
                failed[index] = exc
        alive = bitmask.ne(0).any(dim=1).tolist()
        self.fill_seconds += time.perf_counter() - start
        self.num_fill_rows += len(matchers)
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

