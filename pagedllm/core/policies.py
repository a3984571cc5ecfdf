"""The paper's baselines as policies of our own scheduler: contiguous KV reservation.

Orca and FasterTransformer keep each request's KV cache in one contiguous tensor, so they must
reserve its whole future size when it is admitted. ``ContiguousBlockManager`` reproduces that
inside pagedllm: it answers the same calls as ``BlockSpaceManager`` (the scheduler, worker and
kernels are unchanged), but gives each sequence one run of *consecutive* physical blocks, taken
at admission from a buddy allocator over the same pool and held until the sequence ends. Its
block table is just ``range(start, start + n)``, so every figure compares one engine with itself.

Reservation sizes, in token slots (``p`` = prompt length, ``o`` = the request's true output
length, ``L`` = max_model_len; a sequence writes K/V for ``p + o - 1`` tokens, since the last
sampled token is never fed back):

- ``contiguous-max`` (Orca-Max, FasterTransformer): ``L``, the longest a sequence can become.
- ``contiguous-pow2`` (Orca-Pow2): ``p + 2**ceil(log2 o) - 1``, at most 2x the output over.
- ``contiguous-oracle`` (Orca-Oracle): ``p + o - 1``, exactly what the request will use.

``o`` is ``group.oracle_output_len`` (set by an experiment that knows it); without it, the
request's ``max_tokens`` (capped by ``L - p``) stands in. All are capped at ``L`` and rounded up
to whole blocks (use block_size 1 for token-exact reservation). If a sequence outgrows its run
anyway (a wrong oracle), the run is reallocated at twice the size and its blocks are copied
(``blocks_to_copy``), as a contiguous system would have to: outputs never change with the policy.

Sharing does not exist here (it is what paging adds): each sample of a request has its own run;
a request's runs for all ``best_of`` samples are reserved at admission, and a fork copies the
parent's blocks into the child's run. Prefix caching is off; preemption is by recomputation only
(``can_swap_out`` is False, so the scheduler falls back to it).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.block_manager import AllocStatus
from pagedllm.core.buddy import BuddyAllocator
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus

CONTIGUOUS_POLICIES = ("contiguous-max", "contiguous-pow2", "contiguous-oracle")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def reservation_tokens(policy: str, prompt_len: int, output_len: int, max_model_len: int) -> int:
    """Token slots a contiguous policy reserves for one sequence (see the module docstring)."""
    if policy == "contiguous-max":
        slots = max_model_len
    elif policy == "contiguous-pow2":
        slots = prompt_len + _next_pow2(max(1, output_len)) - 1
    elif policy == "contiguous-oracle":
        slots = prompt_len + max(1, output_len) - 1
    else:
        raise ValueError(f"not a contiguous policy: {policy!r}")
    return max(prompt_len, min(slots, max_model_len))


@dataclass(slots=True)
class ContiguousPlan:
    """An admission planned by check_allocation and carried out by allocate."""

    status: AllocStatus
    num_blocks: int  # blocks of all runs
    num_tokens: int  # tokens the prefill computes (no prefix cache: all of them)
    sizes: list[int]  # run sizes: one per waiting sequence, then the spares for unforked samples


@dataclass(slots=True)
class Run:
    """One sequence's contiguous reservation: blocks [start, start + num_blocks)."""

    start: int
    num_blocks: int


class ContiguousBlockManager:
    """Contiguous per-sequence reservation over the block pool; the BlockSpaceManager interface."""

    def __init__(self, policy: str, block_size: int, num_gpu_blocks: int, max_model_len: int) -> None:
        if policy not in CONTIGUOUS_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(CONTIGUOUS_POLICIES)}, got {policy!r}.")
        self.policy = policy
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = 0
        self.swap_capacity = 0
        self.watermark_blocks = 0
        self.enable_prefix_caching = False
        self.max_model_len = max_model_len
        self.buddy = BuddyAllocator(num_gpu_blocks)
        self.runs: dict[int, Run] = {}  # seq_id -> its run
        # Runs reserved at admission for samples not forked yet, and runs of freed samples of a
        # still-running request (beam search frees and forks every step): keyed by request.
        self.spare_runs: dict[str, list[Run]] = {}
        self._request_of: dict[int, str] = {}  # seq_id -> request id
        self._live: dict[str, int] = {}  # request id -> sequences holding runs
        self._pending_copies: dict[int, list[tuple[int, int]]] = {}  # seq_id -> (src, dst) on next append
        self.num_reallocations = 0
        self.num_fork_copies = 0

    # ------------------------------------------------------------------------------ sizes

    def _output_len(self, group: SequenceGroup) -> int:
        oracle = getattr(group, "oracle_output_len", None)
        prompt_len = len(group.prompt_token_ids)
        if oracle is not None:
            return oracle
        max_tokens = group.sampling_params.max_tokens
        limit = self.max_model_len - prompt_len
        return limit if max_tokens is None else min(max_tokens, limit)

    def _run_blocks(self, group: SequenceGroup, seq: Sequence | None = None) -> int:
        # A run can never be larger than the largest chunk of an empty buddy pool (the largest
        # power of two of blocks in it); the engine caps sequences at the pool too.
        max_len = min(self.max_model_len, self._max_run_blocks() * self.block_size)
        slots = reservation_tokens(self.policy, len(group.prompt_token_ids), self._output_len(group), max_len)
        if seq is not None:
            slots = max(slots, seq.get_len())  # a resumed sequence may already be longer
        return _cdiv(slots, self.block_size)

    def _max_run_blocks(self) -> int:
        return 1 << (self.num_gpu_blocks.bit_length() - 1) if self.num_gpu_blocks else 0

    def _group_runs(self, group: SequenceGroup) -> list[int]:
        """Run sizes (blocks) the group's waiting sequences need, plus spares for unforked samples."""
        seqs = group.get_seqs(SequenceStatus.WAITING)
        sizes = [self._run_blocks(group, seq) for seq in seqs]
        num_spares = max(0, group.max_num_running_seqs() - len(seqs))
        return sizes + [self._run_blocks(group)] * num_spares

    # ------------------------------------------------------------------------- allocation

    def _fits(self, sizes: list[int]) -> bool:
        saved = self.buddy.snapshot()
        try:
            return all(self.buddy.allocate(size) is not None for size in sizes)
        finally:
            self.buddy.restore(saved)

    def check_allocation(self, seq_group: SequenceGroup) -> ContiguousPlan:
        """The runs the group's waiting sequences (and its unforked samples) need, and whether
        they fit now (OK), once others end (LATER) or never (NEVER)."""
        sizes = self._group_runs(seq_group)
        total = sum(sizes)
        num_tokens = sum(seq.get_len() for seq in seq_group.get_seqs(SequenceStatus.WAITING))
        if total > self.num_gpu_blocks or max(sizes, default=0) > self._max_run_blocks():
            status = AllocStatus.NEVER
        elif self._fits(sizes):
            status = AllocStatus.OK
        else:
            # Runs that do not fit even in an empty pool (buddy alignment) would wait forever.
            empty = BuddyAllocator(self.num_gpu_blocks)
            fits_empty = all(empty.allocate(size) is not None for size in sizes)
            status = AllocStatus.LATER if fits_empty else AllocStatus.NEVER
        return ContiguousPlan(status, total, num_tokens, sizes)

    def can_allocate(self, seq_group: SequenceGroup) -> AllocStatus:
        return self.check_allocation(seq_group).status

    def _head_run_blocks(self, seq_group: SequenceGroup) -> int:
        """The largest single run the group needs (what external fragmentation is judged against)."""
        return max(self._group_runs(seq_group), default=0)

    def _take(self, size: int) -> Run:
        start = self.buddy.allocate(size)
        if start is None:
            raise RuntimeError(f"no contiguous run of {size} blocks: check can_allocate first")
        return Run(start, size)

    def allocate(self, seq_group: SequenceGroup, plan: ContiguousPlan | None = None) -> None:
        """Reserve the runs ``plan`` (from check_allocation, nothing changed since) lists."""
        seqs = seq_group.get_seqs(SequenceStatus.WAITING)
        sizes = (plan or self.check_allocation(seq_group)).sizes
        rid = seq_group.request_id
        for seq, size in zip(seqs, sizes):
            if seq.seq_id in self.runs:
                raise RuntimeError(f"sequence {seq.seq_id} already has blocks")
            self.runs[seq.seq_id] = self._take(size)
            self._request_of[seq.seq_id] = rid
            seq.num_computed_tokens = 0
        self._live[rid] = self._live.get(rid, 0) + len(seqs)
        spares = [self._take(size) for size in sizes[len(seqs) :]]
        if spares:
            self.spare_runs.setdefault(rid, []).extend(spares)

    # ------------------------------------------------------------------------------ growth

    def _needs_growth(self, seq: Sequence) -> int:
        """0, or the size of the bigger run the sequence must move to before this step."""
        run = self.runs[seq.seq_id]
        needed = _cdiv(seq.get_len(), self.block_size)
        if needed <= run.num_blocks:
            return 0
        cap = min(_cdiv(self.max_model_len, self.block_size), self._max_run_blocks())
        return max(needed, min(2 * run.num_blocks, max(cap, needed)))

    def can_append_slots(self, seq_group: SequenceGroup) -> bool:
        sizes = [size for seq in seq_group.get_seqs(SequenceStatus.RUNNING) if (size := self._needs_growth(seq))]
        return not sizes or self._fits(sizes)

    def append_slots(self, seq: Sequence) -> list[tuple[int, int]]:
        """Copies the worker must do before this step: a fork's content, or a regrown run."""
        copies = self._pending_copies.pop(seq.seq_id, [])
        new_size = self._needs_growth(seq)
        if new_size:
            old = self.runs[seq.seq_id]
            new = self._take(new_size)
            if copies:
                # A fork not yet copied: its content still lies in the parent's run; copy it
                # straight into the new run.
                copies = [(src, dst - old.start + new.start) for src, dst in copies]
            else:
                num_written = _cdiv(seq.num_computed_tokens, self.block_size)
                copies = [(old.start + i, new.start + i) for i in range(num_written)]
            self.buddy.free(old.start, old.num_blocks)
            self.runs[seq.seq_id] = new
            self.num_reallocations += 1
        return copies

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """The child gets its own run (a spare of its request) holding a copy of the parent's blocks."""
        if child_seq.seq_id in self.runs:
            raise RuntimeError(f"sequence {child_seq.seq_id} already has blocks")
        rid = self._request_of[parent_seq.seq_id]
        parent = self.runs[parent_seq.seq_id]
        spares = self.spare_runs.get(rid)
        run = spares.pop() if spares else self._take(parent.num_blocks)
        if spares is not None and not spares:
            del self.spare_runs[rid]
        if run.num_blocks < parent.num_blocks:
            self.buddy.free(run.start, run.num_blocks)
            run = self._take(parent.num_blocks)
        self.runs[child_seq.seq_id] = run
        self._request_of[child_seq.seq_id] = rid
        self._live[rid] += 1
        num_written = _cdiv(parent_seq.num_computed_tokens, self.block_size)
        self._pending_copies[child_seq.seq_id] = [(parent.start + i, run.start + i) for i in range(num_written)]
        self.num_fork_copies += num_written

    def free(self, seq: Sequence) -> None:
        run = self.runs.pop(seq.seq_id, None)
        if run is None:
            return
        self._pending_copies.pop(seq.seq_id, None)
        rid = self._request_of.pop(seq.seq_id)
        self._live[rid] -= 1
        if self._live[rid] > 0 and seq.is_finished():
            # A finished sample of a running request: its run is kept for the request's later
            # forks (beam search), as a system reserving per request would.
            self.spare_runs.setdefault(rid, []).append(run)
            return
        self.buddy.free(run.start, run.num_blocks)
        if self._live[rid] == 0:
            del self._live[rid]
            for spare in self.spare_runs.pop(rid, []):
                self.buddy.free(spare.start, spare.num_blocks)

    # ------------------------------------------------------------------ the rest of the interface

    def has_blocks(self, seq: Sequence) -> bool:
        return seq.seq_id in self.runs

    def get_block_table(self, seq: Sequence) -> list[int]:
        run = self.runs[seq.seq_id]
        return list(range(run.start, run.start + min(run.num_blocks, _cdiv(seq.get_len(), self.block_size))))

    def get_run(self, seq: Sequence) -> Run:
        return self.runs[seq.seq_id]

    def mark_computed(self, seq: Sequence) -> None:
        """No prefix cache in a contiguous system."""

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        return False  # the scheduler then preempts by recomputation

    def swap_out(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        raise NotImplementedError("contiguous policies preempt by recomputation only")

    def can_swap_in(self, seq_group: SequenceGroup) -> AllocStatus:
        return AllocStatus.NEVER

    def swap_in(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        raise NotImplementedError("contiguous policies preempt by recomputation only")

    # --------------------------------------------------------- accounting (core/waste.py, Figure 2)

    def num_used_blocks(self) -> int:
        return self.num_gpu_blocks - self.buddy.num_free

    def slot_usage(self, seqs: list[Sequence]) -> list[tuple[int, int, int]]:
        """Per sequence holding a run: (seq_id, tokens now, slots reserved)."""
        usage: list[tuple[int, int, int]] = []
        for seq in seqs:
            run = self.runs.get(seq.seq_id)
            if run is not None:
                slots = run.num_blocks * self.block_size
                usage.append((seq.seq_id, min(seq.get_len(), slots), slots))
        return usage

    def num_spare_blocks(self) -> int:
        """Blocks of runs reserved for samples not forked yet (or kept for a request's later forks)."""
        return sum(run.num_blocks for runs in self.spare_runs.values() for run in runs)

    def num_unusable_free_blocks(self, seq_group: SequenceGroup) -> int:
        """Free blocks lying in free runs too small for the group's largest run (external fragmentation)."""
        return self.buddy.num_free_units_in_chunks_below(self._head_run_blocks(seq_group))

    def get_num_free_gpu_blocks(self) -> int:
        return self.buddy.num_free

    def get_num_free_cpu_blocks(self) -> int:
        return 0

    def get_stats(self) -> dict:
        used = self.num_used_blocks()
        largest = self.buddy.largest_free_order()
        return {
            "kv_allocation": self.policy,
            "num_gpu_blocks": self.num_gpu_blocks,
            "num_cpu_blocks": 0,
            "gpu_blocks_used": used,
            "gpu_blocks_free": self.buddy.num_free,
            "gpu_blocks_shared": 0,
            "gpu_blocks_cached": 0,
            "gpu_blocks_evictable": 0,
            "cpu_blocks_used": 0,
            "blocks_saved_by_sharing": 0,
            "num_cow_copies": 0,
            "num_blocks_swapped_out": 0,
            "num_blocks_swapped_in": 0,
            "contiguous_reallocations": self.num_reallocations,
            "contiguous_fork_copied_blocks": self.num_fork_copies,
            "largest_free_run_blocks": (1 << largest) if largest >= 0 else 0,
        }

    def check_invariants(self) -> None:
        allocated = [(run.start, run.num_blocks) for run in self.runs.values()]
        allocated += [(run.start, run.num_blocks) for runs in self.spare_runs.values() for run in runs]
        self.buddy.check_invariants(allocated)
        assert set(self._request_of) == set(self.runs), "request map out of sync"

    def all_free(self) -> bool:
        return not self.runs and not self.spare_runs and self.buddy.num_free == self.num_gpu_blocks
