"""What one step hands between the executor, ``Scheduler.update`` and the engine's output side.

``ModelOutput`` is what the executor returns (the sampler's rows as plain values, the beam
searcher's decisions, the requests it failed alone); ``StepOutputs`` is what ``update`` returns:
per request, the tokens each sequence got, its finish read off the sequences. Nothing here calls
anything: the engine's output processor reads these and never the scheduler. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.beam_step import BeamStep
from pagedllm.sequence import Sequence, SequenceGroup


@dataclass(slots=True)
class RequestFailure:
    """A request whose own processing raised at ``stage`` ("sampling", "scoring beams", ...): it is
    finished alone with an error, the others run on."""

    group: SequenceGroup
    stage: str
    error: BaseException


@dataclass(slots=True)
class ModelOutput:
    """One step's sampler rows, numbered in batch order: the scheduled groups in order, each running
    sequence that computes tokens, ``num_samples`` rows per sequence (core/scheduler.py)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # Per row: {token_id: logprob} with the chosen token and the top ``params.logprobs``, or None.
    top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    # Rows whose sampling raised: their request fails with the exception.
    failed_rows: dict[int, BaseException] = field(default_factory=dict)
    # Beam-search requests' decisions, by request id.
    beam_steps: dict[str, BeamStep] = field(default_factory=dict)
    # Requests the executor failed alone, by request id: left out of the batch (their input could not
    # be built), or sampled but their beams could not be scored. ``update`` skips their rows.
    failed: dict[str, RequestFailure] = field(default_factory=dict)


@dataclass(slots=True)
class NewTokens:
    """The tokens appended to one sequence in a step: one, or a speculating sequence's accepted
    drafts and the token after them. The sequence's status says whether (and why) it finished."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[float]
    # The sequence's cumulative logprob before these tokens: the output side recomputes it exactly
    # when a stop string ends the sequence before the last of them.
    cumulative_logprob_before: float

    @property
    def first_index(self) -> int:
        """The output position of the first of these tokens."""
        return self.seq.get_output_len() - len(self.token_ids)


@dataclass(slots=True)
class RequestStepOutput:
    """One request's step: the sequences that got tokens (in the group's order), or none for a request
    that finished without a token (a pooled prompt, a grammar nothing can continue)."""

    group: SequenceGroup
    new_tokens: list[NewTokens] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.group.is_finished()


@dataclass(slots=True)
class StepOutputs:
    """What ``Scheduler.update`` did: the requests that got tokens or finished, and those that failed."""

    requests: list[RequestStepOutput] = field(default_factory=list)
    failed: list[RequestFailure] = field(default_factory=list)
