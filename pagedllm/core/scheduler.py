"""The scheduler: which sequence groups run this step, and which blocks move.

Policy of the paper and vLLM v0.2: iteration-level (continuous) batching, first come first
served, a request's sequences gang-scheduled as one group. A step is either all prefill or all
decode:

1. If nothing is swapped out, admit waiting groups in arrival order while the budgets allow
   (sequences, batched tokens, free blocks above the watermark). If any was admitted, the step
   is a prefill step of exactly those groups.
2. Otherwise it is a decode step of the running groups, oldest first. When a group cannot get a
   slot for its next token, the newest running group is preempted, all or nothing: by
   recomputation (its blocks are freed; it goes back to the front of the waiting queue and
   later re-runs prompt + generated tokens as one prefill) or by swapping (its blocks move to
   the CPU pool).
3. If nobody was preempted in this step, swapped groups come back, oldest first, before any new
   request is admitted (step 1 waits for the swapped queue to drain).

Priorities (vLLM's priority scheduling): every queue is ordered by (priority, arrival), a lower
priority value first, so "oldest" above reads "most urgent" and "newest" "least urgent"; with
equal priorities (the default, 0) that is first come first served.

A group that can never run (too long for the model, the token budget or the whole pool) is
finished with an error message instead of blocking the queue.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.block_manager import AllocStatus, BlockSpaceManager
from pagedllm.core.policies import ContiguousBlockManager
from pagedllm.core.waste import WasteTracker
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class SchedulerOutputs:
    """What one step runs, and the block moves the worker performs before running it.

    Order for the worker: swap out, swap in, copy, then the forward pass. (Swap-in and swap-out
    never occur in the same step: swap-in only happens when nothing was preempted.)
    """

    scheduled_seq_groups: list[SequenceGroup] = field(default_factory=list)
    is_prefill: bool = False
    num_batched_tokens: int = 0
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


class Scheduler:
    """Owns the waiting / running / swapped queues and the block manager."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_manager: BlockSpaceManager | ContiguousBlockManager
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
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        # Cumulative statistics.
        self.num_preempted_by_recompute = 0
        self.num_preempted_by_swap = 0
        self.num_ignored = 0
        self.num_oversized_recomputes = 0

    # ----------------------------------------------------------------------------------- queues

    def add_seq_group(self, seq_group: SequenceGroup) -> None:
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
                    self.block_manager.free(seq)  # no-op when the engine already freed it
            if not group.is_finished():
                kept.append(group)
        self.running = kept

    # --------------------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutputs:
        now = time.time()
        self.free_finished_seq_groups()
        outputs = SchedulerOutputs()
        # Request-level batching (FasterTransformer): a new batch starts only when the last one is done.
        may_admit = self.scheduler_config.batching == "iteration" or not self.running
        if not self.swapped and may_admit:
            self._schedule_prefills(outputs, now)
        if not outputs.scheduled_seq_groups:
            self._schedule_decodes(outputs)
        if self.waste_tracker is not None:
            seqs = [seq for group in self.running for seq in group.get_seqs(SequenceStatus.RUNNING)]
            self.waste_tracker.observe(self.block_manager, seqs, self.waiting[0] if self.waiting else None)
        return outputs

    def _schedule_prefills(self, outputs: SchedulerOutputs, now: float) -> None:
        config = self.scheduler_config
        num_seqs = sum(group.max_num_running_seqs() for group in self.running)
        while self.waiting:
            group = self.waiting[0]
            if group.is_finished():  # e.g. every sequence finished by the engine while waiting
                self.waiting.popleft()
                continue
            is_recompute = any(seq.output_token_ids for seq in group.get_seqs())
            status, num_blocks, num_tokens = self.block_manager.check_allocation(group)
            error = self._never_fits(group, is_recompute, status, num_blocks, num_tokens)
            if error is not None:
                self._finish_with_error(self.waiting.popleft(), SequenceStatus.FINISHED_IGNORED, error, outputs)
                continue
            if status != AllocStatus.OK:
                break  # head-of-line: FCFS never lets a later request overtake
            group_seqs = group.max_num_running_seqs()
            if num_seqs + group_seqs > config.max_num_seqs:
                break
            if outputs.num_batched_tokens + num_tokens > config.max_num_batched_tokens:
                if not (is_recompute and not outputs.scheduled_seq_groups):
                    break
                # A preempted group that grew past the token budget may still run, alone:
                # dropping its generated tokens would be worse than one oversized step.
                self.num_oversized_recomputes += 1
            self.waiting.popleft()
            self.block_manager.allocate(group)
            for seq in group.get_seqs(SequenceStatus.WAITING):
                seq.status = SequenceStatus.RUNNING
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
                group.metrics.time_in_queue = now - group.metrics.arrival_time
            self.running.append(group)
            outputs.scheduled_seq_groups.append(group)
            outputs.num_batched_tokens += num_tokens
            num_seqs += group_seqs
        if outputs.scheduled_seq_groups:
            outputs.is_prefill = True

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
        if status == AllocStatus.NEVER:
            if is_recompute:
                return self._pool_exhausted_message(group)
            return (
                f"prompt of {prompt_len} tokens needs {num_blocks} KV-cache blocks of "
                f"{self.block_manager.block_size} tokens, but the whole pool has {self.block_manager.num_gpu_blocks}"
            )
        if not is_recompute and num_tokens > config.max_num_batched_tokens:
            return (
                f"prompt needs {num_tokens} tokens in one prefill step, more than "
                f"max_num_batched_tokens={config.max_num_batched_tokens}"
            )
        return None

    def _schedule_decodes(self, outputs: SchedulerOutputs) -> None:
        # Oldest first, so that preemption always takes the newest group.
        queue = deque(sorted(self.running, key=_arrival))
        running: deque[SequenceGroup] = deque()
        preempted: list[SequenceGroup] = []
        while queue:
            group = queue.popleft()
            while not self.block_manager.can_append_slots(group):
                if queue:
                    victim = queue.pop()
                    self._preempt(victim, outputs)
                    preempted.append(victim)
                elif running:
                    # Older groups hold the memory: this group is the newest, so it yields.
                    self._preempt(group, outputs)
                    preempted.append(group)
                    break
                else:
                    # Alone with the whole pool and still no room: it can never grow.
                    self._finish_with_error(
                        group, SequenceStatus.FINISHED_LENGTH_CAPPED, self._pool_exhausted_message(group), outputs
                    )
                    break
            else:
                self._append_slots(group, outputs)
                running.append(group)
        self.running = running

        if not preempted:
            self._swap_in(outputs)
        outputs.scheduled_seq_groups = list(self.running)
        outputs.num_batched_tokens = sum(
            seq.get_len() - seq.num_computed_tokens
            for group in self.running
            for seq in group.get_seqs(SequenceStatus.RUNNING)
        )
        outputs.is_prefill = False

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
            self._append_slots(group, outputs)
            self.running.append(group)
            num_seqs += group_seqs

    def _append_slots(self, group: SequenceGroup, outputs: SchedulerOutputs) -> None:
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            outputs.blocks_to_copy.extend(self.block_manager.append_slots(seq))

    # ------------------------------------------------------------------------------- preemption

    def _preempt(self, group: SequenceGroup, outputs: SchedulerOutputs) -> None:
        mode = self.scheduler_config.preemption_mode
        if mode == "auto":
            # Recomputing n diverged samples costs n prefills; swapping keeps their shared blocks.
            mode = "swap" if len(group.get_unfinished_seqs()) > 1 else "recompute"
        if mode == "recompute" and self._recompute_tokens(group) > self.scheduler_config.max_num_batched_tokens:
            mode = "swap"  # too big to re-run as one prefill: keep its cache if the CPU pool can
        if mode == "swap" and not self.block_manager.can_swap_out(group):
            mode = "recompute"  # the CPU pool is full: recomputation always works
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
        if self.waste_tracker is not None:
            stats["kv_waste"] = self.waste_tracker.summary()
        return stats
