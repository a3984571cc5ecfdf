"""Sequences and sequence groups: the scheduler's unit of work.

A request becomes one SequenceGroup; its sequences (n samples, beams) share the prompt and
are scheduled, preempted and resumed together (gang scheduling, as in the paper).
This module is pure Python: core/ imports it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any

from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()  # rejected by the scheduler (can never fit)

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISHED = {
    SequenceStatus.FINISHED_STOPPED,
    SequenceStatus.FINISHED_LENGTH_CAPPED,
    SequenceStatus.FINISHED_ABORTED,
    SequenceStatus.FINISHED_IGNORED,
}
_FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",
}


class Sequence:
    """One token stream: the shared prompt plus this sequence's own generated tokens."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], block_size: int) -> None:
        self.seq_id = seq_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        # Tokens whose K/V are already in the cache. A prefill computes the rest; after a
        # recompute preemption it drops to 0 and prompt + output run again as one prefill.
        self.num_computed_tokens = 0
        # Chained prefix-cache hashes of this sequence's full blocks, in order (block i's hash names
        # tokens [0, (i + 1) * block_size)). Extended by the block manager as blocks fill, never
        # recomputed: the tokens of a full block never change.
        self.block_hashes: list[int] = []
        self.cumulative_logprob = 0.0
        # Per generated token: {token_id: logprob} with the chosen token and the top k.
        self.output_logprobs: list[dict[int, float]] = []
        self.output_text = ""
        self.stop_reason: int | str | None = None
        # Incremental detokenizer state (see pagedllm/engine/detokenizer.py).
        self.tokens: list[str] | None = None
        self.prefix_offset = 0
        self.read_offset = 0
        # Structured outputs: the grammar matcher (xgrammar's) of this sequence's output so far;
        # every appended token advances it, and a fork gets its own copy.
        self.grammar: Any = None
        # Speculative decoding: this step's draft tokens (verified after the tokens above), and the
        # sequence's own tally, which switches its speculation off when too few are accepted.
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.spec_disabled = False

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    def get_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_next_token_ids(self, num_tokens: int) -> list[int]:
        """The next ``num_tokens`` tokens whose K/V are not computed yet (a decode's one token, or a
        prompt chunk), sliced without concatenating the whole sequence."""
        start, end = self.num_computed_tokens, self.num_computed_tokens + num_tokens
        prompt = self.prompt_token_ids
        num_prompt = len(prompt)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return prompt[start:end]
        return prompt[start:] + self.output_token_ids[: end - num_prompt]

    def get_num_uncomputed_tokens(self) -> int:
        return self.get_len() - self.num_computed_tokens

    def get_last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def append_token(self, token_id: int, logprob: float, top_logprobs: dict[int, float] | None = None) -> None:
        if self.grammar is not None and not self.grammar.accept_token(token_id):
            raise ValueError(f"token {token_id} is outside the sequence's structured-output grammar")
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if top_logprobs is not None:
            self.output_logprobs.append(top_logprobs)

    def truncate_output(self, num_tokens: int, cumulative_logprob: float) -> None:
        """Keep the first ``num_tokens`` generated tokens (a stop string ended the sequence before
        tokens appended after it in the same step); ``cumulative_logprob`` is theirs."""
        del self.output_token_ids[num_tokens:]
        del self.output_logprobs[num_tokens:]
        self.cumulative_logprob = cumulative_logprob

    def is_finished(self) -> bool:
        return self.status.is_finished

    def reset_for_recompute(self) -> None:
        """Forget the cache: the next prefill recomputes prompt and generated tokens."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def fork(self, new_seq_id: int) -> Sequence:
        """A child that continues from this sequence's state (the blocks are forked separately)."""
        child = Sequence(new_seq_id, self.prompt_token_ids, self.block_size)
        child.output_token_ids = list(self.output_token_ids)
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child.cumulative_logprob = self.cumulative_logprob
        child.output_logprobs = list(self.output_logprobs)
        child.output_text = self.output_text
        child.tokens = None if self.tokens is None else list(self.tokens)
        child.prefix_offset = self.prefix_offset
        child.read_offset = self.read_offset
        child.grammar = None if self.grammar is None else self.grammar.fork()
        return child

    def __repr__(self) -> str:
        return f"Sequence(id={self.seq_id}, status={self.status.name}, len={self.get_len()})"


@dataclass
class RequestMetrics:
    """Wall-clock times of one request (seconds since the epoch, time.time())."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None


class SequenceGroup:
    """All sequences of one request, gang-scheduled."""

    def __init__(
        self,
        request_id: str,
        seqs: list[Sequence],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        prompt: str | None = None,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
        pooling_type: str | None = None,
    ) -> None:
        self.request_id = request_id
        # A pooling request (an embedding): its prompt is computed, its final hidden states pooled
        # ("LAST", "MEAN" or "CLS": pooling_type) and it finishes; it never samples, so its
        # sampling_params only make it a single-sequence request for the code that reads them.
        self.pooling_params = pooling_params
        self.pooling_type = pooling_type
        # The pooler's running state across prompt chunks (worker/pooler.py), kept by the engine.
        self.pooled_state: Any = None
        # Lower is served first (vLLM's priority scheduling); equal priorities are first come first served.
        self.priority = priority
        self.seqs = seqs
        self.sampling_params = sampling_params
        self.prompt = prompt
        self.metrics = RequestMetrics(arrival_time=time.time() if arrival_time is None else arrival_time)
        self.error: str | None = None  # set when the scheduler refuses the request, or it fails
        # True when the engine failed while processing this request (a server-side error, not a
        # refusal of its input); the request alone was finished, with ``error`` saying where.
        self.failed = False
        self.num_preemptions = 0
        # Prompt tokens whose K/V came from the prefix cache when the request was first scheduled.
        self.num_cached_tokens: int | None = None
        # The true output length, known only in experiments (a trace supplies it): the
        # contiguous-oracle and contiguous-pow2 policies reserve from it (core/policies.py).
        self.oracle_output_len: int | None = None
        # Beam search's per-request state (pagedllm/engine/beam_search.py), None for other requests.
        # Kept here so it lives and dies with the request, whatever path ends it.
        self.beam_state: Any = None
        # prompt_logprobs: per prompt token {token_id: logprob} (None for the first), once computed.
        self.prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs)
        return [seq for seq in self.seqs if seq.status == status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if not seq.is_finished()]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        return len(self.get_seqs(status))

    def max_num_running_seqs(self) -> int:
        """The most sequences this group can have at once (for the max_num_seqs budget)."""
        params = self.sampling_params
        if params.use_beam_search:
            return params.best_of
        if len(self.seqs) == 1 and not self.seqs[0].output_token_ids:
            return params.best_of  # its samples fork when the prompt is done (maybe in a later chunk)
        return len(self.get_unfinished_seqs())

    def is_finished(self) -> bool:
        return all(seq.is_finished() for seq in self.seqs)

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    def reads_every_prompt_position(self) -> bool:
        """Whether every prompt position's output is needed (prompt logprobs; mean or CLS pooling), so
        no prompt block may come from the prefix cache. LAST pooling needs the last token only, which
        is always computed, so it shares cached prefixes as generation does."""
        if self.sampling_params.prompt_logprobs is not None:
            return True
        return self.is_pooling and self.pooling_type != "LAST"

    def __repr__(self) -> str:
        return f"SequenceGroup(request_id={self.request_id}, seqs={self.seqs})"


@dataclass
class CompletionOutput:
    """One returned sequence of a request (vLLM's shape)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What generate() returns per prompt, and what the engine streams per step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    # error is set and the engine failed on this request (rather than refusing it): a server error.
    failed: bool = False
    # Prompt tokens served from the prefix cache (vLLM's RequestOutput.num_cached_tokens).
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: per prompt token {token_id: logprob} with the prompt's
    # token and the top k; None for the first token (nothing predicts it), as vLLM.
    prompt_logprobs: list[dict[int, float] | None] | None = None
