"""Beam search as data: a request's search state, and one step's decision.

The engine's beam searcher (engine/beam_search.py) ranks the candidates and returns a ``BeamStep``;
``Scheduler.update`` carries it out (forks the surviving beams, frees the dead ones, turns the
chosen candidates into finished hypotheses). Pure Python: no torch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence


@dataclass
class BeamSearchState:
    """Per-request search state, kept on the SequenceGroup (``group.beam_state``)."""

    beam_width: int
    max_new_tokens: int
    # seq_id -> summed log-probability of the running beam (float32 values, as HF keeps them).
    running_scores: dict[int, float] = field(default_factory=dict)
    # Finished hypotheses, best first: (length-penalised score, sequence). At most beam_width.
    finished: list[tuple[float, Sequence]] = field(default_factory=list)
    # HF's is_early_stop_heuristic_unsatisfied: once False, the search ends.
    improvement_possible: bool = True

    @classmethod
    def for_request(cls, params: SamplingParams, prompt_len: int, max_seq_len: int | None) -> BeamSearchState:
        """The state a request starts with: ``best_of`` beams, at most ``max_tokens`` new tokens and
        never past ``max_seq_len`` (None: no such limit)."""
        limits = [params.max_tokens] if params.max_tokens is not None else []
        if max_seq_len is not None:
            limits.append(max_seq_len - prompt_len)
        max_new = min(limits) if limits else sys.maxsize
        return cls(beam_width=params.best_of, max_new_tokens=max(1, max_new))


@dataclass(slots=True)
class BeamChoice:
    """A chosen candidate: beam ``parent`` of the step continued with ``token_id``."""

    parent: int  # index into the step's beams
    token_id: int
    logprob: float  # the token's raw log-probability
    top_logprobs: dict[int, float] | None  # the token and the top ``logprobs`` entries, when asked
    score: float  # the search's running score after the token (processed, float32)


@dataclass(slots=True)
class BeamStep:
    """One step's decision for a beam-search request.

    ``next_beams``: the beams that run on, best first; empty when the search is over. The first
    choice of a parent continues that parent, each further one forks it. ``hypotheses``: the kept
    finished hypotheses, best first, each an earlier one (its Sequence) or a choice finished now.
    """

    next_beams: list[BeamChoice]
    hypotheses: list[tuple[float, Sequence | BeamChoice]]
    improvement_possible: bool = True
