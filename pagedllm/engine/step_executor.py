"""The engine core's executor over a real model: one scheduled step in, its sampled rows out.

It turns the scheduler's decision into the worker's ``StepInput`` (per sequence its chunk of
tokens, block table and sampling row, with grammar masks, prompt-logprob chunks and drafts), runs
the model executor (executor/model_executor.py: the worker, or rank 0 of a tensor-parallel group),
and hands back the sampler's rows as plain data (core/step_output.py's ``ModelOutput``), with each
beam-search request's next beams chosen by the ``BeamSearcher``. It finishes nothing itself: a
request whose own input or beam scoring raised is reported in ``ModelOutput.failed``, and a
sequence whose grammar allows no token is marked finished for ``Scheduler.update`` to free.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.core.interface import BlockManager
from pagedllm.core.scheduler import SchedulerOutputs, sampled_rows
from pagedllm.core.speculator import DRAFT_FROM_MODEL
from pagedllm.core.step_output import ModelOutput, RequestFailure
from pagedllm.engine.beam_search import BeamSearcher
from pagedllm.executor.model_executor import ModelExecutor
from pagedllm.sampling import SamplerOutput, SamplingRow
from pagedllm.sampling.sampler import rewind_generator
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.step_timing import StepTimer
from pagedllm.structured import StructuredOutputManager
from pagedllm.worker.model_runner import SeqStepInput, StepInput
from pagedllm.worker.pooler import accumulate

# Per group in the batch: (sequence, its first sampler row, its rows) for each sequence that computes.
BatchRows = list[tuple[SequenceGroup, list[tuple[Sequence, int, int]]]]


@dataclass
class StepExecutor:
    """``execute(sched) -> ModelOutput`` for the EngineCore. It reads the block manager's tables and
    never changes them."""

    model_executor: ModelExecutor
    block_manager: BlockManager
    structured_outputs: StructuredOutputManager
    beam_searcher: BeamSearcher
    step_timer: StepTimer
    uses_draft_model: bool  # the worker runs a draft model (it needs each sequence's previous token)
    # The seeded requests' own torch generators, by request id (the engine adds and drops them).
    generators: dict[str, torch.Generator] = field(default_factory=dict)
    num_steps: int = 0

    def __post_init__(self) -> None:
        # Without a runner in this process (tensor parallelism) the whole execution counts as "forward".
        self._runner_timed = self.model_executor.attach_step_timer(self.step_timer)

    def execute(self, sched: SchedulerOutputs) -> ModelOutput:
        """The step's input built, the forward pass run, its sampler output (prompt logprobs, model
        drafts, pooled states taken first) returned as plain rows."""
        timer = self.step_timer
        failed: dict[str, RequestFailure] = {}
        with timer.phase("prepare_inputs"):
            step_input, batch = self._build_step_input(sched, failed)
        if self._runner_timed:  # the worker and runner time their own phases
            sampler_output = self.model_executor.execute(step_input)
        else:
            with timer.phase("forward"):
                sampler_output = self.model_executor.execute(step_input)
        self.num_steps += 1
        with timer.phase("process_outputs"):
            self._add_prompt_logprobs(sched, sampler_output.prompt_logprobs)
            self._take_model_drafts(sched, sampler_output.model_draft_token_ids)
            self._take_pooled(sched, sampler_output.pooled)
            output = ModelOutput(sampler_output.token_ids, sampler_output.logprobs, sampler_output.top_logprobs,
                                 sampler_output.failed_rows, failed=failed)
            for group, seq_rows in batch:
                if group.sampling_params.use_beam_search:
                    self._select_beams(group, seq_rows, sampler_output, output)
                else:
                    self._rewind_generators(group, seq_rows, sampler_output)
        return output

    # ------------------------------------------------------------------ after the forward pass

    def _select_beams(
        self, group: SequenceGroup, seq_rows: list[tuple[Sequence, int, int]], sampler_output: SamplerOutput,
        output: ModelOutput,
    ) -> None:
        beams = [seq for seq, _, num_rows in seq_rows if num_rows]
        rows = [row for _, row, num_rows in seq_rows if num_rows]
        if not beams or any(row in sampler_output.failed_rows for row in rows):
            return  # mid-prompt, or a row failed: the update reports the request's sampling failure
        try:
            output.beam_steps[group.request_id] = self.beam_searcher.select(
                group, beams, sampler_output.full_logprobs[rows])
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
            output.failed[group.request_id] = RequestFailure(group, "scoring beams", exc)

    def _rewind_generators(
        self, group: SequenceGroup, seq_rows: list[tuple[Sequence, int, int]], sampler_output: SamplerOutput
    ) -> None:
        """A speculating sequence's rows after its first rejected draft drew for nothing: their random
        draws are taken back. Parallel samples share the request's generator and draw in turn: taking
        one sample's draws back would hand its numbers to the others. They keep every draw (still
        exact in distribution, reproducible), only a lone sequence is rewound. Rows past a stop would
        be rewound too, but a finished request draws nothing more."""
        generator = self.generators.get(group.request_id)
        if generator is None or group.num_seqs() != 1:
            return
        for seq, row, _ in seq_rows:
            state = sampler_output.generator_states.get(row)
            drafts = seq.spec_token_ids
            if state is None or not drafts:
                continue
            num_rows_used = 1
            while num_rows_used <= len(drafts) and sampler_output.token_ids[row + num_rows_used - 1] == drafts[
                    num_rows_used - 1]:
                num_rows_used += 1
            rewind_generator(generator, state, num_rows_used, group.sampling_params)

    @staticmethod
    def _add_prompt_logprobs(sched: SchedulerOutputs, computed: dict[int, list]) -> None:
        """Append this step's prompt logprobs (one prompt chunk's) to their groups'."""
        for group, _, chunk in _scheduled_seqs_in(sched, computed):
            # The first token has no logprob: nothing predicts it.
            group.prompt_logprobs = (group.prompt_logprobs or [None]) + chunk

    @staticmethod
    def _take_pooled(sched: SchedulerOutputs, pooled: dict[int, Any]) -> None:
        """Fold this step's pooled chunks into their requests' pooling state."""
        for group, _, chunk in _scheduled_seqs_in(sched, pooled):
            group.pooled_state = accumulate(group.pooled_state, chunk, group.pooling_type)

    @staticmethod
    def _take_model_drafts(sched: SchedulerOutputs, drafts: dict[int, list[int]]) -> None:
        """The draft model's drafts replace the stand-ins the scheduler booked, before verification."""
        for _, seq, seq_drafts in _scheduled_seqs_in(sched, drafts):
            seq.spec_token_ids = seq_drafts

    # ------------------------------------------------------------------ the step's input

    def _build_step_input(self, sched: SchedulerOutputs, failed: dict[str, RequestFailure]) -> tuple[StepInput,
                                                                                                      BatchRows]:
        """The worker's input, and where each group's sampler rows are; a request whose input raised
        leaves the batch and goes to ``failed``."""
        seqs: list[SeqStepInput] = []
        batch: BatchRows = []
        scheduled: list[SequenceGroup] = []
        row = 0
        planned = self._plan_sampling(sched, failed)
        bitmasks, grammar_errors = self._grammar_bitmasks(
            [seq for _, plan in planned for seq, _, num_rows in plan if num_rows])
        for group, plan in planned:
            generator = self.generators.get(group.request_id)
            group_seqs: list[SeqStepInput] = []
            seq_rows: list[tuple[Sequence, int, int]] = []
            group_row = row
            try:
                for seq, _, _ in plan:
                    if seq.seq_id in grammar_errors:
                        raise grammar_errors[seq.seq_id]
                for index, (seq, num_tokens, num_rows) in enumerate(p for p in plan if not p[0].is_finished()):
                    seq_rows.append((seq, group_row, num_rows))
                    group_row += num_rows
                    group_seqs.append(self._seq_input(group, seq, num_tokens, num_rows, index, generator,
                                                      bitmasks.get(seq.seq_id)))
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                failed[group.request_id] = RequestFailure(group, "preparing its step", exc)
                continue
            # A group whose every sequence a grammar ended stays in the step: update reports it finished.
            seqs.extend(group_seqs)
            scheduled.append(group)
            batch.append((group, seq_rows))
            row = group_row
        # A failed group leaves the batch; blocks it frees later may still appear in this step's copies
        # and swaps, which is harmless: nothing allocates them before the step runs.
        sched.scheduled_seq_groups = scheduled
        return StepInput(
            seqs=seqs,
            blocks_to_swap_in=sched.blocks_to_swap_in,
            blocks_to_swap_out=sched.blocks_to_swap_out,
            blocks_to_copy=sched.blocks_to_copy,
        ), batch

    def _seq_input(
        self, group: SequenceGroup, seq: Sequence, num_tokens: int, num_rows: int, index: int,
        generator: torch.Generator | None, bitmask: object,
    ) -> SeqStepInput:
        params = group.sampling_params
        row = SamplingRow(params, seq.prompt_token_ids, seq.output_token_ids, generator, bitmask) if num_rows else None
        top_k, next_token = self._prompt_logprob_chunk(group, seq, num_tokens) if index == 0 else (None, None)
        drafts = seq.spec_token_ids
        # A draft model's drafts are stand-ins here: the worker's draft model makes them.
        model_drafts = len(drafts) if drafts and drafts[0] == DRAFT_FROM_MODEL else 0
        start = seq.num_computed_tokens
        previous = (seq.get_token_ids()[start - 1] if self.uses_draft_model and start and start >= seq.prompt_len
                    else None)
        return SeqStepInput(
            seq_id=seq.seq_id,
            token_ids=seq.get_next_token_ids(num_tokens - len(drafts)) + (drafts if not model_drafts else []),
            start_pos=seq.num_computed_tokens,
            block_table=self.block_manager.get_block_table(seq),
            sampling_row=row,
            num_samples=1 if drafts else max(num_rows, 1),
            prompt_logprobs=top_k,
            next_prompt_token=next_token,
            draft_token_ids=list(drafts) if not model_drafts else [],
            num_model_drafts=model_drafts,
            previous_token_id=previous,
            pooling_type=group.pooling_type,
        )

    @staticmethod
    def _plan_sampling(
        sched: SchedulerOutputs, failed: dict[str, RequestFailure]
    ) -> list[tuple[SequenceGroup, list[tuple[Sequence, int, int]]]]:
        """Per scheduled group: its sequences that compute tokens this step, with their tokens and
        sampler rows (0 for a chunk mid-prompt)."""
        planned = []
        for group in sched.scheduled_seq_groups:
            try:
                planned.append((group, sampled_rows(group, sched.num_scheduled_tokens)))
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                failed[group.request_id] = RequestFailure(group, "preparing its step", exc)
        return planned

    @staticmethod
    def _prompt_logprob_chunk(group: SequenceGroup, seq: Sequence, num_tokens: int) -> tuple[int | None, int | None]:
        """(top-k, the prompt token after the chunk) when this step's tokens of ``seq`` are the next prompt
        chunk whose logprobs the request asked for, else (None, None). Chunks come in order, each
        predicting the next chunk's first token too; never again after a recompute."""
        top_k = group.sampling_params.prompt_logprobs
        prompt_len, start = len(seq.prompt_token_ids), seq.num_computed_tokens
        if top_k is None or start >= prompt_len or len(group.prompt_logprobs or []) != (start + 1 if start else 0):
            return None, None
        end = start + num_tokens
        return top_k, seq.prompt_token_ids[end] if end < prompt_len else None

    def _grammar_bitmasks(self, sampling: list[Sequence]) -> tuple[dict[int, object], dict[int, BaseException]]:
        """This step's bitmask of each constrained sequence that samples, by seq id, filled for the whole
        batch at once (per-request fills cost a tensor allocation and a reduction each); and the
        sequences whose matcher raised. A sequence whose grammar allows no token at all (a constraint
        nothing can satisfy) is marked finished here; ``Scheduler.update`` frees it.

        A speculating sequence gets ``[drafts + 1, words]``, one mask per sampler row: row j's is the
        grammar's state after drafts[:j] (SeqStepInput.sampling_rows hands them out); its matcher is
        walked through the drafts and rolled back, so verification appends from its own state."""
        constrained = [seq for seq in sampling if seq.grammar is not None]
        if not constrained:
            return {}, {}
        drafts = [seq.spec_token_ids for seq in constrained]
        matchers = [seq.grammar for seq in constrained]
        if any(drafts):
            bitmask, alive, failed = self.structured_outputs.fill_bitmasks(matchers, drafts)
        else:  # the plain call, one row per sequence
            bitmask, alive, failed = self.structured_outputs.fill_bitmasks(matchers)
        masks: dict[int, object] = {}
        errors: dict[int, BaseException] = {}
        row = 0
        for index, seq in enumerate(constrained):
            num_rows = 1 + len(drafts[index])
            if index in failed:
                errors[seq.seq_id] = failed[index]
            elif alive[row]:  # the sequence's own state (the drafts after it were accepted by the grammar)
                masks[seq.seq_id] = bitmask[row] if num_rows == 1 else bitmask[row : row + num_rows]
            else:
                seq.status = SequenceStatus.FINISHED_ABORTED
                seq.stop_reason = "structured output: no token can continue the grammar"
            row += num_rows
        return masks, errors


def _scheduled_seqs_in(
    sched: SchedulerOutputs, values: dict[int, Any]
) -> Iterator[tuple[SequenceGroup, Sequence, Any]]:
    """(group, sequence, value) for every scheduled sequence ``values`` (by seq id) has an entry for."""
    if not values:
        return
    for group in sched.scheduled_seq_groups:
        for seq in group.seqs:
            if seq.seq_id in values:
                yield group, seq, values[seq.seq_id]
