"""The engine's output side: the scheduler's per-request step outputs in, ``RequestOutput``s out.

For every request that got tokens or finished in a step (core/step_output.py's
``RequestStepOutput``) it detokenizes each sequence's new tokens (engine/detokenizer.py), cuts a
stop token's text and looks for stop strings (core/stop_checker.py's ``check_stop_text``; the
token half of the stop check ran in ``Scheduler.update``), stamps the request's token times, and
builds its ``RequestOutput``, or a pooling request's ``PoolingRequestOutput`` with its embedding.

It never calls the scheduler (vLLM V1's split): a sequence a stop string ends is marked finished
here and returned in ``ProcessedOutputs.stopped``, and the engine core frees its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.step_output import NewTokens, RequestFailure, RequestStepOutput
from pagedllm.core.stop_checker import check_stop_text
from pagedllm.engine.detokenizer import detokenize_incrementally
from pagedllm.pooling_outputs import PoolingOutput, PoolingRequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import CompletionOutput, RequestOutput, Sequence, SequenceGroup, SequenceStatus
from pagedllm.worker.pooler import finish


@dataclass(slots=True)
class ProcessedOutputs:
    """One step's outputs; the sequences stop strings ended (their blocks still held); the requests
    whose processing raised here (not in ``outputs``)."""

    outputs: list[RequestOutput | PoolingRequestOutput] = field(default_factory=list)
    stopped: list[Sequence] = field(default_factory=list)
    failed: list[RequestFailure] = field(default_factory=list)


class OutputProcessor:
    """``normalize_pooled``: whether pooled embeddings are L2-normalized by default (the pooler config's)."""

    def __init__(self, tokenizer: Any, normalize_pooled: bool = True) -> None:
        self.tokenizer = tokenizer
        self.normalize_pooled = normalize_pooled
        # What was being done for a request when its processing raised, for the error message.
        self._stage = ""

    def process(self, requests: list[RequestStepOutput], now: float) -> ProcessedOutputs:
        """Text, stop strings and outputs for one step's requests; ``now`` is the step's time."""
        processed = ProcessedOutputs()
        for request in requests:
            group = request.group
            try:
                self._stage = "detokenizing"
                params = group.sampling_params
                if params.detokenize:
                    for new in request.new_tokens:
                        if self._add_text(new, params):
                            processed.stopped.append(new.seq)
                self._stage = "building its output"
                metrics = group.metrics
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                metrics.last_token_time = now
                if group.is_finished():
                    metrics.finished_time = now
                processed.outputs.append(self.make_output(group))
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                processed.failed.append(RequestFailure(group, self._stage, exc))
        return processed

    def _add_text(self, new: NewTokens, params: SamplingParams) -> bool:
        """Detokenize ``new``'s tokens one by one, each checked as if it had come alone; returns whether
        a stop string ended the sequence (tokens appended after that one in the step are dropped)."""
        seq = new.seq
        # check_stop ends a sequence as "stopped" only on a stop token, and only on the last new token.
        stopped_by_token = seq.status is SequenceStatus.FINISHED_STOPPED
        first, last = new.first_index, len(new.token_ids) - 1
        for offset in range(last + 1):
            position = first + offset
            self._stage = "detokenizing"
            new_text = detokenize_incrementally(self.tokenizer, seq, params, position)
            self._stage = "checking stop conditions"
            if check_stop_text(seq, params, len(new_text), position + 1, stopped_by_token and offset == last):
                if offset < last:
                    cumulative_logprob = new.cumulative_logprob_before
                    for logprob in new.logprobs[: offset + 1]:
                        cumulative_logprob += logprob  # summed in the order the sequence summed them
                    seq.truncate_output(position + 1, cumulative_logprob)
                return True
        return False

    def make_output(self, group: SequenceGroup) -> RequestOutput | PoolingRequestOutput:
        """The request's output as it stands (cumulative: all text and tokens so far)."""
        if group.is_pooling:
            return self._pooling_output(group)
        params = group.sampling_params
        seqs = group.get_seqs()
        if params.use_beam_search:
            # The best n hypotheses once finished, the best n running beams while it runs (group.seqs
            # holds the beams, then the hypotheses, each best first).
            seqs = seqs[: params.n]
        elif group.is_finished() and params.best_of > params.n:
            # best_of: return the n candidates with the highest cumulative log-probability.
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        completions = [
            CompletionOutput(
                index=i,
                text=seq.output_text,
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.output_logprobs) if params.logprobs is not None else None,
                finish_reason=seq.status.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for i, seq in enumerate(seqs)
        ]
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=group.is_finished(),
            metrics=group.metrics,
            error=group.error,
            failed=group.failed,
            num_cached_tokens=group.num_cached_tokens or 0,
            prompt_logprobs=group.prompt_logprobs,
        )

    def error_output(self, group: SequenceGroup) -> RequestOutput | PoolingRequestOutput:
        """The output of a request failed alone (``group.error`` set); a bare one if even that raises."""
        try:
            return self.make_output(group)
        except Exception:  # noqa: BLE001 - a bare output still carries the error
            return RequestOutput(
                request_id=group.request_id, prompt=group.prompt,
                prompt_token_ids=list(group.seqs[0].prompt_token_ids) if group.seqs else [],
                outputs=[], finished=True, metrics=group.metrics, error=group.error, failed=True,
            )

    def _pooling_output(self, group: SequenceGroup) -> PoolingRequestOutput:
        finished = group.is_finished()
        data = None
        if finished and group.error is None:
            data = finish(group.pooled_state, group.pooling_type, group.pooling_params, self.normalize_pooled)
            group.pooled_state = None
        return PoolingRequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=None if data is None else PoolingOutput(data),
            finished=finished,
            metrics=group.metrics,
            error=group.error,
            failed=group.failed,
            num_cached_tokens=group.num_cached_tokens or 0,
        )
