"""Where ``Scheduler.postprocess`` hands the sampled tokens of a step.

The engine's sink reads the sampler's output (tokens, logprobs), detokenizes, checks stop
conditions and runs beam search; ``ScriptedTokens`` serves runs without a model (the simulator,
the dashboard's simulation, tests): tokens come from a function, and a sequence ends at its
request's ``max_tokens`` (or another stop: core/stop_checker.py, the engine's own, with no EOS and
no text).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pagedllm.core.stop_checker import check_stop
from pagedllm.sequence import Sequence, SequenceGroup


class TokenSink(Protocol):
    def append_token(self, group: SequenceGroup, seq: Sequence, row: int) -> None:
        """Append the token sampled in sampler row ``row`` to ``seq``; set a finished status if it stops."""

    def step_beams(self, group: SequenceGroup, beams: list[Sequence], rows: list[int]) -> int:
        """Advance a beam-search group by one token (``rows[i]`` is ``beams[i]``'s sampler row);
        the sink forks and frees beams through the scheduler. Returns the tokens generated."""

    def drafts_verified(self, group: SequenceGroup, first_row: int, num_rows_used: int) -> None:
        """A speculating sequence's rows from ``first_row`` on: only the first ``num_rows_used`` gave
        tokens; the random draws of the others are taken back."""


class ScriptedTokens:
    """Tokens from ``token_fn(group, seq)``; each sequence stops as the engine's would, at its
    request's ``max_tokens``, a stop token id or ``max_model_len`` (EOS and stop strings need a
    tokenizer; there is none).

    Beams have nothing to rank without a model: each beam simply takes its next token.
    """

    def __init__(self, token_fn: Callable[[SequenceGroup, Sequence], int] = lambda group, seq: 0,
                 max_model_len: int | None = None) -> None:
        self.token_fn = token_fn
        self.max_model_len = max_model_len

    def append_token(self, group: SequenceGroup, seq: Sequence, row: int) -> None:
        seq.append_token(self.token_fn(group, seq), 0.0)
        check_stop(seq, group.sampling_params, 0, None, self.max_model_len)

    def step_beams(self, group: SequenceGroup, beams: list[Sequence], rows: list[int]) -> int:
        for beam, row in zip(beams, rows):
            self.append_token(group, beam, row)
        return len(beams)

    def drafts_verified(self, group: SequenceGroup, first_row: int, num_rows_used: int) -> None:
        """Scripted tokens draw nothing."""
