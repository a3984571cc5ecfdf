"""The scheduler: which sequences run this step, how many tokens each, and which blocks move.

First come first served, iteration-level (continuous) batching, a request's sequences
gang-scheduled as one group. Two policies:

**One token budget per step** (``enable_chunked_prefill``, the default; vLLM V1, SGLang):

1. Running groups that decode get their token first, oldest first. When a group cannot get a
   slot for its next token, the newest running group is preempted, all or nothing: by
   recomputation (its blocks are freed; it goes back to the front of the waiting queue and
   later re-runs prompt + generated tokens, in chunks) or by swapping (its blocks move to the
   CPU pool).
2. If nobody was preempted, swapped groups come back, oldest first.
3. The rest of the budget goes to prompts, first come first served: groups whose prompt is
   partly computed (they keep their blocks), then waiting groups, admitted while blocks and
   the budget allow (in a step that decodes, at most ``max_prefill_tokens_while_decoding``
   prompt tokens in all, when set). A prompt longer than what is left of the budget gets a chunk
   and continues next step; prefix-cache hits skip their tokens. The sequences of a group finish
   their prompts in the same step (so that n samples fork, and beams start, together).

**All prefill or all decode** (the paper and vLLM v0.2; kept for the paper's figures): if any
waiting group can be admitted (nothing swapped out, whole prompts within the budget), the step
is a prefill step of exactly those; otherwise it is a decode step of the running groups, with
preemption and swapping in as above.

Priorities (vLLM's priority scheduling): every queue is ordered by (priority, arrival), a lower
priority value first, so "oldest" above reads "most urgent" and "newest" "least urgent"; with
equal priorities (the default, 0) that is first come first served.

A group that can never run (too long for the model, the budget or the whole pool) is finished
with an error message instead of blocking the queue.

After the forward pass, ``update`` does the bookkeeping for every caller (the engine, the
simulator, the tests' fake engines): advance computed tokens, offer computed blocks to the
prefix cache, fork parallel samples when a prompt's last chunk is done, append the sampled
tokens and check their stop tokens and lengths, carry out the beam searcher's decisions, free
finished sequences; it returns per request the tokens each sequence got (core/step_output.py).

A pooling request (an embedding) is a prompt and nothing more: it is admitted, chunked and preempted
as any prompt, samples no row, never speculates, and finishes (its blocks freed) in the step that
computes its prompt's last token.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.beam_step import BeamChoice, BeamSearchState, BeamStep
from pagedllm.core.block_manager import AllocStatus, BlockSpaceManager
from pagedllm.core.interface import AllocationPlanLike, BlockManager
from pagedllm.core.policies import ContiguousBlockManager
from pagedllm.core.speculator import Speculator
from pagedllm.core.step_output import ModelOutput, NewTokens, RequestFailure, RequestStepOutput, StepOutputs
from pagedllm.core.stop_checker import check_stop
from pagedllm.core.waste import WasteTracker
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class SchedulerOutputs:
    """What one step runs, and the block moves the worker performs before running it.

    Order for the worker: swap out, swap in, copy, then the forward pass. (Swap-in and swap-out
    never occur in the same step: swap-in only happens when nothing was preempted.)
    """

    scheduled_seq_groups: list[SequenceGroup] = field(default_factory=list)
    # Tokens each scheduled sequence computes this step, by seq_id: 1 for a decode, a prompt
    # chunk's length otherwise. A running sequence absent from it computes nothing this step.
    num_scheduled_tokens: dict[int, int] = field(default_factory=dict)
    num_batched_tokens: int = 0
    num_decode_tokens: int = 0  # of num_batched_tokens, one per decoding sequence
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), device pool
    # Groups finished by the scheduler itself (FINISHED_IGNORED, or FINISHED_LENGTH_CAPPED when a
    # running group outgrew the whole pool); each has group.error set. The engine reports them.
    ignored_seq_groups: list[SequenceGroup] = field(default_factory=list)
    num_preempted: int = 0
    num_preempted_by_recompute: int = 0
    num_preempted_by_swap: int = 0

    def is_empty(self) -> bool:
        return (
            not self.scheduled_seq_groups
            and not self.blocks_to_swap_in
            and not self.blocks_to_swap_out
            and not self.blocks_to_copy
        )


def _arrival(group: SequenceGroup) -> tuple[int, float]:
    """The queue order: priority first (lower value first), then arrival."""
    return group.priority, group.metrics.arrival_time


def _is_decoding(group: SequenceGroup) -> bool:
    """Every running sequence has exactly one token to compute (its last sampled one)."""
    return all(seq.get_num_uncomputed_tokens() == 1 for seq in group.get_seqs(SequenceStatus.RUNNING))


def num_samples(group: SequenceGroup, seq: Sequence, num_tokens: int) -> int:
    """Sampler rows ``seq`` produces when it computes ``num_tokens`` more tokens this step: none
    while its prompt is unfinished, best_of on the prompt's last chunk of a sampled request (the
    extra samples become forks sharing its blocks), one otherwise."""
    if seq.num_computed_tokens + num_tokens < seq.get_len() or group.is_pooling:
        return 0  # a pooling request's hidden states are pooled, never sampled
    if seq.spec_token_ids:  # a row per draft position and one after the last draft
        return len(seq.spec_token_ids) + 1
    params = group.sampling_params
    if not seq.output_token_ids and not params.use_beam_search:
        return params.best_of
    return 1


def sampled_rows(group: SequenceGroup, num_scheduled_tokens: dict[int, int]) -> list[tuple[Sequence, int, int]]:
    """The group's running sequences that compute tokens this step, in batch order, each with its
    tokens and its sampler rows: (sequence, num_tokens, num_rows). The executor builds the batch in
    this order and ``update`` reads the rows back in it."""
    plan = []
    for seq in group.get_seqs(SequenceStatus.RUNNING):
        num_tokens = num_scheduled_tokens.get(seq.seq_id, 0)
        if num_tokens:
            plan.append((seq, num_tokens, num_samples(group, seq, num_tokens)))
    return plan


class Scheduler:
    """Owns the waiting / running / swapped queues and the block manager.

    ``eos_token_id`` and ``max_seq_len`` (the most tokens a sequence may hold: the model's context,
    or less when the pool holds less) are the stops ``update`` checks besides each request's own;
    None leaves them out (runs without a tokenizer or a model)."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        eos_token_id: int | None = None,
        max_seq_len: int | None = None,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.eos_token_id = eos_token_id
        self.max_seq_len = max_seq_len
        self.block_manager: BlockManager
        if scheduler_config.kv_allocation == "paged":
            self.block_manager = BlockSpaceManager(
                block_size=cache_config.block_size,
                num_gpu_blocks=num_gpu_blocks,
                num_cpu_blocks=num_cpu_blocks,
                watermark=scheduler_config.watermark,
                enable_prefix_caching=cache_config.enable_prefix_caching,
                sliding_window=cache_config.sliding_window,
            )
        else:
            # The paper's contiguous baselines: same interface, one reserved run per sequence.
            self.block_manager = ContiguousBlockManager(
                scheduler_config.kv_allocation, cache_config.block_size, num_gpu_blocks, scheduler_config.max_model_len
            )
        self.waste_tracker = WasteTracker() if scheduler_config.track_kv_waste else None
        self.speculator: Speculator | None = None
        if scheduler_config.speculative_config is not None:
            if scheduler_config.kv_allocation != "paged":
                raise ValueError("speculative decoding needs kv_allocation='paged' (drafts take lookahead blocks).")
            self.speculator = Speculator(scheduler_config.speculative_config, scheduler_config.max_model_len)
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        # Sequence ids for new requests and for forks (samples, beams): one counter, no clashes.
        self._seq_ids = itertools.count()
        # Cumulative statistics.
        self.num_preempted_by_recompute = 0
        self.num_preempted_by_swap = 0
        self.num_ignored = 0
        self.num_oversized_recomputes = 0
        self.num_prompt_tokens = 0  # prompt tokens computed (prefix-cache hits excluded)
        self.num_generation_tokens = 0  # tokens sampled
        # What update was doing for a request when its processing raised, for the error message.
        self._stage = ""

    # ----------------------------------------------------------------------------------- queues

    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        params = seq_group.sampling_params
        if params.use_beam_search and seq_group.beam_state is None:
            seq_group.beam_state = BeamSearchState.for_request(
                params, len(seq_group.prompt_token_ids), self.max_seq_len)
        self._enqueue_waiting(seq_group)

    def _enqueue_waiting(self, seq_group: SequenceGroup) -> None:
        """Into the waiting queue at its (priority, arrival) place; the common case is an append."""
        key = _arrival(seq_group)
        index = len(self.waiting)
        while index and _arrival(self.waiting[index - 1]) > key:
            index -= 1
        self.waiting.insert(index, seq_group)

    def abort_seq_group(self, request_id: str | Iterable[str]) -> None:
        """Finish the named groups wherever they are, freeing their blocks (unknown ids are ignored)."""
        request_ids = {request_id} if isinstance(request_id, str) else set(request_id)
        if not request_ids:
            return
        for queue in (self.waiting, self.running, self.swapped):
            kept = deque()
            for group in queue:
                if group.request_id not in request_ids:
                    kept.append(group)
                    continue
                for seq in group.get_seqs():
                    if not seq.is_finished():
                        seq.status = SequenceStatus.FINISHED_ABORTED
                    self.block_manager.free(seq)
                if self.speculator is not None:
                    self.speculator.request_finished(group)
            queue.clear()
            queue.extend(kept)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def free_seq(self, seq: Sequence) -> None:
        self.block_manager.free(seq)

    def fork_seq(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        self.block_manager.fork(parent_seq, child_seq)

    def free_finished_seq_groups(self) -> None:
        """Drop finished groups from the running queue (and any blocks their finished seqs still hold)."""
        kept = deque()
        for group in self.running:
            for seq in group.get_seqs():
                if seq.is_finished():
                    self.block_manager.free(seq)  # no-op when already freed
            if not group.is_finished():
                kept.append(group)
            elif self.speculator is not None:
                self.speculator.request_finished(group)
        self.running = kept

    # --------------------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutputs:
        now = time.time()
        self.free_finished_seq_groups()
        outputs = SchedulerOutputs()
        if self.scheduler_config.enable_chunked_prefill:
            preempted = self._schedule_running(outputs)
            if not preempted:
                self._swap_in(outputs)
            self._schedule_prompts(outputs, now, preempted)
        else:
            if not self.swapped and self._may_admit():
                self._admit_whole_prompts(outputs, now)
            if not outputs.scheduled_seq_groups:
                preempted = self._schedule_running(outputs)
                if not preempted:
                    self._swap_in(outputs)
        if self.waste_tracker is not None:
            seqs = [seq for group in self.running for seq in group.get_seqs(SequenceStatus.RUNNING)]
            self.waste_tracker.observe(self.block_manager, seqs, self.waiting[0] if self.waiting else None)
        return outputs

    def _may_admit(self) -> bool:
        # Request-level batching (FasterTransformer): a new batch starts only when the last one is done.
        return self.scheduler_config.batching == "iteration" or not self.running

    def _budget_left(self, outputs: SchedulerOutputs) -> int:
        return self.scheduler_config.max_num_batched_tokens - outputs.num_batched_tokens

    def _prompt_budget_left(self, outputs: SchedulerOutputs) -> int:
        """What prompt chunks may still take this step: the budget's rest and, in a step that
        decodes, at most ``max_prefill_tokens_while_decoding`` prompt tokens in all."""
        left = self._budget_left(outputs)
        cap = self.scheduler_config.max_prefill_tokens_while_decoding
        if cap > 0 and outputs.num_decode_tokens > 0:
            left = min(left, cap - (outputs.num_batched_tokens - outputs.num_decode_tokens))
        return left

    def _add_tokens(self, group: SequenceGroup, chunks: list[tuple[Sequence, int]], outputs: SchedulerOutputs) -> None:
        scheduled = False
        for seq, num_tokens in chunks:
            if num_tokens > 0:
                outputs.num_scheduled_tokens[seq.seq_id] = num_tokens
                outputs.num_batched_tokens += num_tokens
                scheduled = True
        if scheduled:
            outputs.scheduled_seq_groups.append(group)

    def _schedule_decode(self, group: SequenceGroup, outputs: SchedulerOutputs) -> None:
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        for seq in seqs:
            outputs.blocks_to_copy.extend(self.block_manager.append_slots(seq))
        chunks = [(seq, 1 + len(seq.spec_token_ids)) for seq in seqs]
        self._add_tokens(group, chunks, outputs)
        outputs.num_decode_tokens += sum(num_tokens for _, num_tokens in chunks)

    def _decode_fits(self, group: SequenceGroup, outputs: SchedulerOutputs) -> bool:
        if not self.scheduler_config.enable_chunked_prefill:
            return True  # a decode step has one token per running sequence, within max_num_seqs
        return group.num_seqs(SequenceStatus.RUNNING) <= self._budget_left(outputs)

    def _propose_drafts(self, group: SequenceGroup, outputs: SchedulerOutputs) -> None:
        """Draft tokens for the group's decodes this step, within what the token budget leaves after
        every sequence's own token."""
        assert self.speculator is not None
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        budget = self._budget_left(outputs) - len(seqs)
        for seq in seqs:
            seq.spec_token_ids = self.speculator.propose(group, seq, budget) if budget > 0 else []
            budget -= len(seq.spec_token_ids)

    @staticmethod
    def _drop_drafts(group: SequenceGroup) -> None:
        for seq in group.get_seqs():
            seq.spec_token_ids = []

    def _schedule_running(self, outputs: SchedulerOutputs) -> bool:
        """Decode tokens for running groups, oldest first, preempting the newest when blocks run
        out. Groups still in their prompt keep their place (and blocks) for a chunk later.
        Returns whether anything was preempted."""
        # Oldest first, so that preemption always takes the newest group.
        queue = deque(sorted(self.running, key=_arrival))
        running: deque[SequenceGroup] = deque()
        preempted = False
        speculate = self.speculator is not None and self.speculator.enabled_for_batch(
            sum(group.num_seqs(SequenceStatus.RUNNING) for group in self.running))
        while queue:
            group = queue.popleft()
            if not _is_decoding(group) or not self._decode_fits(group, outputs):
                running.append(group)  # a prompt chunk below, or a decode next step
                continue
            if speculate and not group.is_pooling:
                self._propose_drafts(group, outputs)
                if not self.block_manager.can_append_slots(group):
                    self._drop_drafts(group)  # drafts never cost a preemption: without them the decode may fit
            while not self.block_manager.can_append_slots(group):
                preempted = True
                if queue:
                    self._preempt(queue.pop(), outputs)
                elif running:
                    # Older groups hold the memory: this group is the newest, so it yields.
                    self._preempt(group, outputs)
                    break
                else:
                    # Alone with the whole pool and still no room: it can never grow.
                    self._finish_with_error(
                        group, SequenceStatus.FINISHED_LENGTH_CAPPED, self._pool_exhausted_message(group), outputs
                    )
                    break
            else:
                self._schedule_decode(group, outputs)
                running.append(group)
        self.running = running
        return preempted

    def _swap_in(self, outputs: SchedulerOutputs) -> None:
        num_seqs = sum(group.max_num_running_seqs() for group in self.running)
        self.swapped = deque(sorted(self.swapped, key=_arrival))
        while self.swapped:
            group = self.swapped[0]
            status = self.block_manager.can_swap_in(group)
            if status == AllocStatus.NEVER:
                self._finish_with_error(
                    self.swapped.popleft(),
                    SequenceStatus.FINISHED_LENGTH_CAPPED,
                    self._pool_exhausted_message(group),
                    outputs,
                )
                continue
            if status == AllocStatus.LATER:
                break
            group_seqs = group.max_num_running_seqs()
            if num_seqs + group_seqs > self.scheduler_config.max_num_seqs:
                break
            self.swapped.popleft()
            outputs.blocks_to_swap_in.extend(self.block_manager.swap_in(group))
            for seq in group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
            if _is_decoding(group) and self._decode_fits(group, outputs):
                self._schedule_decode(group, outputs)
            self.running.append(group)  # a group swapped out mid-prompt continues with a chunk
            num_seqs += group_seqs

    # ---------------------------------------------------------------------------------- prompts

    def _schedule_prompts(self, outputs: SchedulerOutputs, now: float, preempted: bool) -> None:
        """Prompt chunks in arrival order: groups already admitted, then waiting groups (none in a
        step that had to preempt: memory is short)."""
        for group in sorted((g for g in self.running if not _is_decoding(g)), key=_arrival):
            if self._prompt_budget_left(outputs) <= 0:
                return
            self._add_tokens(group, self._prompt_chunks(group, outputs), outputs)
        if preempted or self.swapped or not self._may_admit():
            return
        # Request-level batching admits the whole next batch at once; its prompts are then
        # computed in chunks over the following steps.
        batch_at_once = self.scheduler_config.batching == "request"
        num_seqs = sum(group.max_num_running_seqs() for group in self.running)
        while self.waiting and (batch_at_once or self._prompt_budget_left(outputs) > 0):
            group = self.waiting[0]
            plan = self._plan_admission(group, outputs)
            if plan is None:
                continue
            group_seqs = group.max_num_running_seqs()  # before admission: best_of of a fresh request
            if plan.status != AllocStatus.OK or num_seqs + group_seqs > self.scheduler_config.max_num_seqs:
                break  # head-of-line: FCFS never lets a later request overtake
            self._admit(group, plan, now)
            num_seqs += group_seqs
            self._add_tokens(group, self._prompt_chunks(group, outputs), outputs)

    def _prompt_chunks(self, group: SequenceGroup, outputs: SchedulerOutputs) -> list[tuple[Sequence, int]]:
        """Tokens each running sequence of the group computes this step, within the budget left.

        All of what is left when it fits (within ``long_prefill_token_threshold`` per group, when
        set, and ``long_prompt_chunk_tokens`` for a group too long for the budget); otherwise as
        much as fits with every sequence stopping short of its last token, so that the group's
        sequences finish their prompts (and sample their first tokens) in the same step.
        """
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        left = self._prompt_budget_left(outputs)
        config = self.scheduler_config
        threshold = config.long_prefill_token_threshold
        if config.long_prompt_chunk_tokens > 0 and sum(seq.get_len() for seq in seqs) > config.max_num_batched_tokens:
            threshold = min(threshold or config.long_prompt_chunk_tokens, config.long_prompt_chunk_tokens)
        if threshold > 0:
            # Progress even below one token per sequence: a sequence with one token left waits,
            # and a group with one left in each is decoding (its tokens are not a prompt chunk).
            left = min(left, threshold)
        remaining = [seq.get_num_uncomputed_tokens() for seq in seqs]
        if sum(remaining) <= left:
            return list(zip(seqs, remaining))
        chunks = []
        for seq, num_left in zip(seqs, remaining):
            num_tokens = max(0, min(num_left - 1, left))
            chunks.append((seq, num_tokens))
            left -= num_tokens
        return chunks

    def _plan_admission(self, group: SequenceGroup, outputs: SchedulerOutputs) -> AllocationPlanLike | None:
        """The allocation plan of the head of the waiting queue; None when it left the queue
        instead (finished while waiting, or refused with an error because it can never run)."""
        if group.is_finished():  # e.g. every sequence finished by the engine while waiting
            self.waiting.popleft()
            return None
        is_recompute = any(seq.output_token_ids for seq in group.get_seqs())
        plan = self.block_manager.check_allocation(group)
        error = self._never_fits(group, is_recompute, plan.status, plan.num_blocks, plan.num_tokens)
        if error is not None:
            self._finish_with_error(self.waiting.popleft(), SequenceStatus.FINISHED_IGNORED, error, outputs)
            return None
        return plan

    def _admit(self, group: SequenceGroup, plan: AllocationPlanLike, now: float) -> None:
        """Move the head of the waiting queue to the running queue with the blocks ``plan`` lays out."""
        self.waiting.popleft()
        self.block_manager.allocate(group, plan)
        for seq in group.get_seqs(SequenceStatus.WAITING):
            seq.status = SequenceStatus.RUNNING
        if group.metrics.first_scheduled_time is None:
            group.metrics.first_scheduled_time = now
            group.metrics.time_in_queue = now - group.metrics.arrival_time
        if group.num_cached_tokens is None:
            group.num_cached_tokens = group.seqs[0].num_computed_tokens
        self.running.append(group)

    def _admit_whole_prompts(self, outputs: SchedulerOutputs, now: float) -> None:
        """A prefill step (chunking off): whole prompts of waiting groups while the budget allows."""
        config = self.scheduler_config
        num_seqs = sum(group.max_num_running_seqs() for group in self.running)
        while self.waiting:
            group = self.waiting[0]
            plan = self._plan_admission(group, outputs)
            if plan is None:
                continue
            group_seqs = group.max_num_running_seqs()  # before admission: best_of of a fresh request
            if plan.status != AllocStatus.OK or num_seqs + group_seqs > config.max_num_seqs:
                break
            if outputs.num_batched_tokens + plan.num_tokens > config.max_num_batched_tokens:
                is_recompute = any(seq.output_token_ids for seq in group.get_seqs())
                if not (is_recompute and not outputs.scheduled_seq_groups):
                    break
                # A preempted group that grew past the token budget may still run, alone:
                # dropping its generated tokens would be worse than one oversized step.
                self.num_oversized_recomputes += 1
            self._admit(group, plan, now)
            num_seqs += group_seqs
            chunks = [(seq, seq.get_num_uncomputed_tokens()) for seq in group.get_seqs(SequenceStatus.RUNNING)]
            self._add_tokens(group, chunks, outputs)

    def _never_fits(
        self, group: SequenceGroup, is_recompute: bool, status: AllocStatus, num_blocks: int, num_tokens: int
    ) -> str | None:
        """Why a waiting group can never be scheduled, or None."""
        config = self.scheduler_config
        prompt_len = len(group.prompt_token_ids)
        if not is_recompute and prompt_len > config.max_model_len:
            return f"prompt has {prompt_len} tokens, more than max_model_len={config.max_model_len}"
        max_seqs = group.max_num_running_seqs()
        if max_seqs > config.max_num_seqs:
            return f"request needs {max_seqs} sequences (n/best_of), more than max_num_seqs={config.max_num_seqs}"
        if config.enable_chunked_prefill and max_seqs > config.max_num_batched_tokens:
            return (
                f"request decodes {max_seqs} sequences per step, more than "
                f"max_num_batched_tokens={config.max_num_batched_tokens}"
            )
        if status == AllocStatus.NEVER:
            if is_recompute:
                return self._pool_exhausted_message(group)
            return (
                f"prompt of {prompt_len} tokens needs {num_blocks} KV-cache blocks of "
                f"{self.block_manager.block_size} tokens, but the whole pool has {self.block_manager.num_gpu_blocks}"
            )
        if not config.enable_chunked_prefill and not is_recompute and num_tokens > config.max_num_batched_tokens:
            return (
                f"prompt needs {num_tokens} tokens in one prefill step, more than "
                f"max_num_batched_tokens={config.max_num_batched_tokens} (enable chunked prefill to split it)"
            )
        return None

    # ------------------------------------------------------------------------------- preemption

    def _preempt(self, group: SequenceGroup, outputs: SchedulerOutputs) -> None:
        config = self.scheduler_config
        mode = config.preemption_mode
        if mode == "auto":
            # Recomputing n diverged samples costs n prefills; swapping keeps their shared blocks.
            mode = "swap" if len(group.get_unfinished_seqs()) > 1 else "recompute"
        if (
            mode == "recompute"
            and not config.enable_chunked_prefill
            and self._recompute_tokens(group) > config.max_num_batched_tokens
        ):
            mode = "swap"  # too big to re-run as one prefill: keep its cache if the CPU pool can
        if mode == "swap" and not self.block_manager.can_swap_out(group):
            mode = "recompute"  # the CPU pool is full: recomputation always works
        self._drop_drafts(group)
        group.num_preemptions += 1
        outputs.num_preempted += 1
        if mode == "swap":
            outputs.blocks_to_swap_out.extend(self.block_manager.swap_out(group))
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            outputs.num_preempted_by_swap += 1
            self.num_preempted_by_swap += 1
        else:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                self.block_manager.free(seq)
                seq.reset_for_recompute()
            self._enqueue_waiting(group)  # ahead of the later arrivals of its priority
            outputs.num_preempted_by_recompute += 1
            self.num_preempted_by_recompute += 1

    @staticmethod
    def _recompute_tokens(group: SequenceGroup) -> int:
        return sum(seq.get_len() for seq in group.get_seqs(SequenceStatus.RUNNING))

    def _finish_with_error(
        self, group: SequenceGroup, status: SequenceStatus, message: str, outputs: SchedulerOutputs
    ) -> None:
        for seq in group.get_seqs():
            if not seq.is_finished():
                seq.status = status
            self.block_manager.free(seq)
        group.error = f"request {group.request_id}: {message}"
        outputs.ignored_seq_groups.append(group)
        self.num_ignored += 1

    def _pool_exhausted_message(self, group: SequenceGroup) -> str:
        lengths = [seq.get_len() for seq in group.get_unfinished_seqs()]
        bm = self.block_manager
        return (
            f"the KV cache is exhausted: {len(lengths)} sequence(s) of up to {max(lengths, default=0)} tokens "
            f"need more than the whole pool of {bm.num_gpu_blocks} blocks of {bm.block_size} tokens"
        )

    # ----------------------------------------------------------------------------------- update

    def update(self, outputs: SchedulerOutputs, model_output: ModelOutput) -> StepOutputs:
        """The bookkeeping after a forward pass of ``outputs`` (every caller runs this one).

        Per scheduled group: advance each sequence's computed tokens by what it computed, offer
        newly full blocks to the prefix cache, and for the sequences that sampled (their whole
        prompt is now computed) append the sampled tokens and check their stops (core/stop_checker.py:
        stop tokens, lengths), forking the extra samples of a prompt's first token, or carry out a
        beam-search request's ``BeamStep``; free what finished.

        Returns per request the tokens each sequence got (plain data: nothing is called back). An
        exception while updating one group is recorded in the result and the other groups carry on;
        so are the requests the executor failed alone (``model_output.failed``), whose rows are skipped.
        The caller finishes the failed groups.
        """
        result = StepOutputs(failed=list(model_output.failed.values()))
        row = 0
        for group in outputs.scheduled_seq_groups:
            plan = sampled_rows(group, outputs.num_scheduled_tokens)
            first_row = row
            row += sum(num_rows for _, _, num_rows in plan)  # counted before anything can fail
            if group.request_id in model_output.failed:
                continue
            self._stage = "processing its output"
            try:
                request = self._update_group(group, plan, first_row, model_output)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                result.failed.append(RequestFailure(group, self._stage, exc))
                continue
            if request is not None:
                result.requests.append(request)
        self.free_finished_seq_groups()
        return result

    def _update_group(
        self, group: SequenceGroup, plan: list[tuple[Sequence, int, int]], row: int, model_output: ModelOutput
    ) -> RequestStepOutput | None:
        """The group's step; None when it got no token and did not finish (a prompt chunk mid-prompt)."""
        new_tokens: list[NewTokens] = []
        # (sequence, its rows, its first row): rows follow the order of the group's sequences.
        sampled: list[tuple[Sequence, int, int]] = []
        for seq, num_tokens, num_rows in plan:
            seq_row, row = row, row + num_rows
            if seq.spec_token_ids:
                new_tokens.append(self._verify_drafts(group, seq, seq_row, model_output))
                continue
            if not seq.output_token_ids:
                self.num_prompt_tokens += num_tokens
            seq.num_computed_tokens += num_tokens
            self.block_manager.mark_computed(seq)
            if num_rows:
                sampled.append((seq, num_rows, seq_row))
        if group.is_pooling:
            return RequestStepOutput(group) if self._finish_pooled(group, plan) else None
        if sampled and group.sampling_params.use_beam_search:
            self._check_rows([first for _, _, first in sampled], model_output)
            self._stage = "processing its output"
            beams = [seq for seq, _, _ in sampled]
            new_tokens = self._apply_beam_step(group, beams, model_output.beam_steps[group.request_id])
            self.num_generation_tokens += len(beams)
        else:
            for seq, num_rows, seq_row in sampled:
                targets = [seq]
                for _ in range(num_rows - 1):
                    child = seq.fork(self.next_seq_id())
                    self.fork_seq(seq, child)  # shares every block; copy-on-write at the first divergent write
                    group.seqs.append(child)  # the group owns it at once: a failure below frees it too
                    targets.append(child)
                for offset, target in enumerate(targets):
                    new = NewTokens(target, [], [], target.cumulative_logprob)
                    self._append_row(group, target, seq_row + offset, model_output, new)
                    new_tokens.append(new)
                    if target.is_finished():
                        self.block_manager.free(target)
        if not new_tokens and not group.is_finished():
            return None
        return RequestStepOutput(group, new_tokens)

    def _check_rows(self, rows: Iterable[int], model_output: ModelOutput) -> None:
        """Raise a row's sampling failure (its request fails at "sampling")."""
        self._stage = "sampling"
        for row in rows:
            if row in model_output.failed_rows:
                raise model_output.failed_rows[row]

    def _append_row(
        self, group: SequenceGroup, seq: Sequence, row: int, model_output: ModelOutput, new: NewTokens
    ) -> None:
        """Append sampler row ``row``'s token to ``seq`` (and to ``new``) and check its stop."""
        self._check_rows((row,), model_output)
        self._stage = "processing its output"
        token_id, logprob = model_output.token_ids[row], model_output.logprobs[row]
        seq.append_token(token_id, logprob, model_output.top_logprobs[row])
        new.token_ids.append(token_id)
        new.logprobs.append(logprob)
        self.num_generation_tokens += 1
        self._stage = "checking stop conditions"
        check_stop(seq, group.sampling_params, self.eos_token_id, self.max_seq_len)

    def _apply_beam_step(self, group: SequenceGroup, beams: list[Sequence], step: BeamStep) -> list[NewTokens]:
        """Carry out the searcher's decision: the surviving beams fork from their parents (sharing every
        block; copy-on-write at the first divergent write), a beam without a survivor frees its
        references, and the chosen finished candidates become hypotheses (they hold no blocks: their
        K/V are never read again). Afterwards ``group.seqs`` holds the new beams, then the kept
        hypotheses; when the search is over only the hypotheses, all finished."""
        params = group.sampling_params
        # Hypotheses first, while every parent still has its pre-step state: a fork copies it.
        kept: list[tuple[float, Sequence]] = []
        chosen: list[tuple[Sequence, BeamChoice, bool]] = []
        for score, entry in step.hypotheses:
            if isinstance(entry, BeamChoice):
                hypothesis = beams[entry.parent].fork(self.next_seq_id())
                chosen.append((hypothesis, entry, True))
                kept.append((score, hypothesis))
            else:
                kept.append((score, entry))
        survivors: list[tuple[Sequence, BeamChoice]] = []
        continued: set[int] = set()
        for choice in step.next_beams:
            parent = beams[choice.parent]
            if choice.parent not in continued:
                continued.add(choice.parent)  # the first survivor continues the parent itself
                survivors.append((parent, choice))
            else:
                child = parent.fork(self.next_seq_id())
                self.fork_seq(parent, child)
                group.seqs.append(child)  # the group owns it at once: a failure below frees it too
                survivors.append((child, choice))
        for index, parent in enumerate(beams):
            if index not in continued:
                # A dead beam only drops its references: blocks shared with survivors stay.
                parent.status = SequenceStatus.FINISHED_ABORTED
                self.free_seq(parent)
        chosen = [(seq, choice, False) for seq, choice in survivors] + chosen
        new_tokens = []
        for seq, choice, is_hypothesis in chosen:
            new_tokens.append(NewTokens(seq, [choice.token_id], [choice.logprob], seq.cumulative_logprob))
            seq.append_token(choice.token_id, choice.logprob, choice.top_logprobs)
            # The search ranks by its own (processed, float32) sum; report that one.
            seq.cumulative_logprob = choice.score
            # A stop token sets the status as for any other sequence (a running beam never takes one).
            check_stop(seq, params, self.eos_token_id, self.max_seq_len)
            if is_hypothesis and not seq.is_finished():
                seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED  # a hypothesis is always finished
        state = group.beam_state
        state.finished = kept
        state.running_scores = {seq.seq_id: choice.score for seq, choice in survivors}
        state.improvement_possible = step.improvement_possible
        group.seqs = [seq for seq, _ in survivors] + [seq for _, seq in kept]
        return new_tokens

    def _finish_pooled(self, group: SequenceGroup, plan: list[tuple[Sequence, int, int]]) -> bool:
        """A pooling request ends with its prompt: its blocks go back at once (full ones stay in the
        prefix cache, computed, for later requests). Returns whether it finished this step."""
        finished = False
        for seq, _, _ in plan:
            if seq.num_computed_tokens >= seq.get_len():
                seq.status = SequenceStatus.FINISHED_STOPPED
                self.block_manager.free(seq)
                finished = True
        return finished

    def _verify_drafts(self, group: SequenceGroup, seq: Sequence, row: int, model_output: ModelOutput) -> NewTokens:
        """Keep the drafts the target agrees with, and the target's own token after them.

        Sampler row j sampled the target's token after the sequence's tokens and drafts[:j]. Going
        left to right, each row's token is appended (so stop conditions and logprobs are those of
        ordinary decoding); while it equals draft j, that draft's K/V computed this step is valid
        and the next row follows it. With a draft given as one token, accepting it when the row's own
        sample equals it is exactly rejection sampling: it is accepted with the target's probability
        of that token, and a rejection leaves a sample of the target's distribution without it.
        The blocks only rejected drafts were written to go back to the pool.
        """
        drafts = seq.spec_token_ids
        seq.spec_token_ids = []
        seq.num_computed_tokens += 1  # the sequence's last token
        accepted = 0
        new = NewTokens(seq, [], [], seq.cumulative_logprob)
        try:
            for j in range(len(drafts) + 1):
                self._append_row(group, seq, row + j, model_output, new)
                if seq.is_finished() or j == len(drafts) or seq.output_token_ids[-1] != drafts[j]:
                    break
                accepted += 1
                seq.num_computed_tokens += 1  # draft j is now the sequence's token, its K/V in place
        finally:
            assert self.speculator is not None
            self.speculator.record(seq, len(drafts), accepted)
            if seq.is_finished():
                self.block_manager.free(seq)
            else:
                self.block_manager.release_lookahead(seq)
                self.block_manager.mark_computed(seq)
        return new

    # ------------------------------------------------------------------------------- statistics

    def get_stats(self) -> dict:
        stats = {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_swapped": len(self.swapped),
            "num_preempted": self.num_preempted_by_recompute + self.num_preempted_by_swap,
            "num_preempted_by_recompute": self.num_preempted_by_recompute,
            "num_preempted_by_swap": self.num_preempted_by_swap,
            "num_ignored": self.num_ignored,
            "num_oversized_recomputes": self.num_oversized_recomputes,
        }
        stats.update(self.block_manager.get_stats())
        if self.speculator is not None:
            stats.update(self.speculator.get_stats())
        if self.waste_tracker is not None:
            stats["kv_waste"] = self.waste_tracker.summary()
        return stats
