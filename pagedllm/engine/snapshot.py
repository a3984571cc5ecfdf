"""A read-only picture of the KV pools and the scheduler's queues, for the live dashboard.

``take_snapshot(scheduler)`` walks the block manager once (pure Python, no torch) and returns
plain lists and dicts that share nothing with the engine: the caller takes it between steps (on
the engine's thread) and may encode it anywhere afterwards. Nothing here mutates engine state.

Block states (the ``map.state`` codes, also used by the page's colours):

- ``FREE`` (0): holds nothing.
- ``CACHED`` (1): no sequence references it, but its K/V stay in the prefix cache until a fresh
  allocation evicts it (counted as allocatable, like free).
- ``OWNED`` (2): held by sequences of one request through one reference (ref count 1).
- ``SHARED`` (3): ref count > 1 (forked samples and beams, or requests sharing a cached prefix).
- ``SWAPPED`` (4): a block of the CPU swap pool holding a preempted request's K/V.

Block counts: ``total = free + cached + used`` for the device pool; ``used`` counts blocks held
by live sequences (ref count > 0) and ``shared`` the subset with a ref count above one;
``swapped`` counts used blocks of the CPU pool.

Memory in the paper's Figure 2 categories (token slots of the device pool, see core/waste.py),
measured at this instant: ``token`` slots hold a token's K/V; of the allocated slots that do
not yet, ``reserved`` ones may still be written (the sequence can grow into them) and
``internal`` ones never will (beyond the sequence's ``max_tokens`` or the model's length);
``external`` is free space too fragmented for the next waiting request (zero under paging);
``free`` is the rest. An instant cannot know that a sequence will stop early, so a slot counted
as reserved here may end up internal in waste.py's after-the-fact accounting.
"""

from __future__ import annotations

from typing import Any

from pagedllm.core.block_manager import BlockSpaceManager
from pagedllm.core.policies import ContiguousBlockManager
from pagedllm.core.waste import measure_step
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus

FREE, CACHED, OWNED, SHARED, SWAPPED = 0, 1, 2, 3, 4
STATE_NAMES = ("free", "cached", "owned", "shared", "swapped")

# Waiting requests hold no blocks; listing thousands of them would only bloat every update.
MAX_WAITING_ROWS = 100


class _PoolMap:
    """Per-block arrays of one pool, filled from the block tables of the live sequences."""

    __slots__ = ("state", "ref", "owner", "fill", "owners")

    def __init__(self, num_blocks: int) -> None:
        self.state = [FREE] * num_blocks
        self.ref = [0] * num_blocks
        self.owner = [-1] * num_blocks  # index into the snapshot's request list, -1 for none
        self.fill = [0] * num_blocks  # token slots written, of block_size
        self.owners: dict[int, list[int]] = {}  # blocks held by more than one request

    def hold(self, block_id: int, request_index: int, fill: int) -> None:
        owner = self.owner[block_id]
        if owner == -1:
            self.owner[block_id] = request_index
        elif owner != request_index:
            others = self.owners.setdefault(block_id, [owner])
            if request_index not in others:
                others.append(request_index)
        if fill > self.fill[block_id]:
            self.fill[block_id] = fill

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "ref": self.ref, "owner": self.owner, "fill": self.fill,
                "owners": {str(block_id): indices for block_id, indices in self.owners.items()}}


def _live_groups(scheduler: Any) -> list[tuple[str, SequenceGroup]]:
    """(state, group) for every unfinished request, the ones holding blocks first."""
    groups = [("running", group) for group in scheduler.running]
    groups += [("swapped", group) for group in scheduler.swapped]
    groups += [("waiting", group) for group in scheduler.waiting]
    return groups


def _growth_left(group: SequenceGroup, seq: Sequence, max_model_len: int | None) -> int:
    """How many more tokens ``seq`` may still write (its remaining ``max_tokens``, capped by the model)."""
    max_tokens = group.sampling_params.max_tokens
    oracle = getattr(group, "oracle_output_len", None)
    limit = oracle if oracle is not None else max_tokens
    left = (limit - seq.get_output_len()) if limit is not None else 1 << 30
    if max_model_len is not None:
        left = min(left, max_model_len - seq.get_len())
    return max(0, left)


def _device_table(block_manager: Any, seq: Sequence) -> tuple[list[int], str] | None:
    """The block ids ``seq`` holds and the pool they are in, or None."""
    if isinstance(block_manager, BlockSpaceManager):
        table = block_manager.block_tables.get(seq.seq_id)
        if not table:
            return None
        return [block.block_id for block in table.blocks], table.blocks[0].device
    if isinstance(block_manager, ContiguousBlockManager) and block_manager.has_blocks(seq):
        run = block_manager.get_run(seq)
        return list(range(run.start, run.start + run.num_blocks)), "gpu"
    return None


def take_snapshot(scheduler: Any, max_model_len: int | None = None) -> dict[str, Any]:
    """The pools, queues, memory categories and live requests of ``scheduler`` right now.

    Cost: one pass over both pools and every live block table (O(blocks + table entries)).
    Works for the paged BlockSpaceManager and the contiguous baselines (no CPU pool there).
    """
    block_manager = scheduler.block_manager
    bs = block_manager.block_size
    num_gpu = block_manager.num_gpu_blocks
    paged = isinstance(block_manager, BlockSpaceManager)
    gpu = _PoolMap(num_gpu)
    cpu = _PoolMap(block_manager.num_cpu_blocks if paged else 0)
    if paged:
        for pool_map, allocator in ((gpu, block_manager.gpu_allocator), (cpu, block_manager.cpu_allocator)):
            ref, state = pool_map.ref, pool_map.state
            for block in allocator.blocks:
                count = block.ref_count
                ref[block.block_id] = count
                if count > 1:
                    state[block.block_id] = SHARED
                elif count == 1:
                    state[block.block_id] = OWNED
                elif block.content_id is not None:
                    state[block.block_id] = CACHED
                    pool_map.fill[block.block_id] = bs  # only full blocks are cached
        for block_id, count in enumerate(cpu.ref):
            if count:
                cpu.state[block_id] = SWAPPED

    requests: list[dict[str, Any]] = []
    running_seqs: list[Sequence] = []
    num_waiting_rows = 0
    num_omitted = 0
    growth_by_seq: dict[int, int] = {}
    for state, group in _live_groups(scheduler):
        if state == "waiting":
            if num_waiting_rows >= MAX_WAITING_ROWS:
                num_omitted += 1
                continue
            num_waiting_rows += 1
        index = len(requests)
        held: set[tuple[str, int]] = set()
        output_tokens = 0
        num_seqs = 0
        for seq in group.seqs:
            if seq.is_finished():
                continue
            num_seqs += 1
            output_tokens = max(output_tokens, seq.get_output_len())
            if seq.status == SequenceStatus.RUNNING:
                running_seqs.append(seq)
                growth_by_seq[seq.seq_id] = _growth_left(group, seq, max_model_len)
            located = _device_table(block_manager, seq)
            if located is None:
                continue
            block_ids, device = located
            pool_map = gpu if device == "gpu" else cpu
            seq_len = seq.get_len()
            for position, block_id in enumerate(block_ids):
                pool_map.hold(block_id, index, min(bs, max(0, seq_len - position * bs)))
                held.add((device, block_id))
        if not paged:
            for run in block_manager.spare_runs.get(group.request_id, ()):  # reserved for unforked samples
                for block_id in range(run.start, run.start + run.num_blocks):
                    gpu.hold(block_id, index, 0)
                    held.add(("gpu", block_id))
        shared = sum(1 for device, block_id in held if (gpu if device == "gpu" else cpu).ref[block_id] > 1)
        requests.append({
            "id": group.request_id, "state": state, "prompt_tokens": len(group.prompt_token_ids),
            "output_tokens": output_tokens, "num_seqs": num_seqs, "blocks": len(held), "shared_blocks": shared,
            "preemptions": group.num_preemptions,
        })
    if not paged:
        for block_id, owner in enumerate(gpu.owner):
            if owner != -1:
                gpu.state[block_id] = OWNED
                gpu.ref[block_id] = 1

    head = scheduler.waiting[0] if scheduler.waiting else None
    waste = _instant_waste(block_manager, running_seqs, head, growth_by_seq)
    num_used = num_gpu - gpu.ref.count(0)
    num_cached = gpu.state.count(CACHED)
    return {
        "block_size": bs,
        "kv_allocation": "paged" if paged else block_manager.policy,
        "blocks": {
            "total": num_gpu,
            "free": num_gpu - num_used - num_cached,
            "used": num_used,
            "shared": gpu.state.count(SHARED),
            "cached": num_cached,
            "swapped": cpu.state.count(SWAPPED),
            "allocatable": num_gpu - num_used,  # what a fresh allocation can get: free + cached
            "cpu_total": len(cpu.ref),
        },
        "queues": {"running": len(scheduler.running), "waiting": len(scheduler.waiting),
                   "swapped": len(scheduler.swapped)},
        "waste": waste,
        "sharing": _sharing(block_manager, gpu, cpu),
        "requests": requests,
        "requests_omitted": num_omitted,
        "map": gpu.as_dict(),
        "cpu_map": cpu.as_dict(),
    }


def _instant_waste(block_manager: Any, running_seqs: list[Sequence], head: SequenceGroup | None,
                   growth_by_seq: dict[int, int]) -> dict[str, int]:
    """Figure 2's categories in token slots of the device pool, at this instant."""
    usage = measure_step(block_manager, running_seqs, head)
    reserved = usage.reserved_now
    internal = 0
    for seq_id, tokens, slots in usage.unfilled_by_seq:
        unfilled = slots - tokens
        # Slots past what the sequence may still write can never hold a token: fragmentation now.
        can_write = min(unfilled, growth_by_seq.get(seq_id, unfilled))
        reserved += can_write
        internal += unfilled - can_write
    token = usage.used - reserved - internal
    return {"token": token, "reserved": reserved, "internal": internal, "external": usage.external,
            "free": usage.total - usage.used - usage.external, "total": usage.total}


def _sharing(block_manager: Any, gpu: _PoolMap, cpu: _PoolMap) -> dict[str, Any]:
    """Blocks saved by sharing now, split by cause, plus the cumulative counters behind it.

    A block referenced r times by sequences of k distinct requests saves r - 1 copies: k - 1 of
    them thanks to prefix caching (other requests mapped it), r - k thanks to forks (samples and
    beams of one request share it until copy-on-write separates them).
    """
    saved_by_prefix = saved_by_forks = 0
    for pool_map in (gpu, cpu):
        ref = pool_map.ref
        for block_id, count in enumerate(ref):
            if count > 1:
                num_requests = len(pool_map.owners.get(block_id, ())) or 1
                saved_by_prefix += num_requests - 1
                saved_by_forks += count - num_requests
    stats = block_manager.get_stats()
    return {
        "blocks_saved": saved_by_prefix + saved_by_forks,
        "saved_by_forks": saved_by_forks,
        "saved_by_prefix": saved_by_prefix,
        "cow_copies": stats.get("num_cow_copies", 0),
        "prefix_hit_tokens": stats.get("prefix_cache_hit_tokens", 0),
        "prefix_queried_tokens": stats.get("prefix_cache_queried_tokens", 0),
        "prefix_evictions": stats.get("prefix_cache_evictions", 0),
        "swapped_out_blocks": stats.get("num_blocks_swapped_out", 0),
    }


def engine_counters(engine: Any) -> dict[str, float]:
    """Cumulative counters the charts turn into rates (read on the engine thread)."""
    scheduler = engine.scheduler
    return {
        "prompt_tokens": getattr(engine, "num_prompt_tokens", 0),
        "generation_tokens": getattr(engine, "num_generation_tokens", 0),
        "preemptions": scheduler.num_preempted_by_recompute + scheduler.num_preempted_by_swap,
        "steps": getattr(engine, "num_steps", 0),
    }


def engine_snapshot(engine: Any) -> dict[str, Any]:
    """``take_snapshot`` of an LLMEngine's scheduler plus its ``counters``; call it between steps."""
    snapshot = take_snapshot(engine.scheduler, getattr(engine, "max_seq_len", None))
    snapshot["counters"] = engine_counters(engine)
    return snapshot


async def capture_between_steps(async_engine: Any) -> dict[str, Any]:
    """The snapshot of an AsyncLLMEngine's engine, taken on its engine thread (so between two steps)."""
    async_engine.check_alive()  # a dead engine's state is not worth drawing (EngineDeadError)
    return await async_engine.run_in_engine_thread(lambda: engine_snapshot(async_engine.engine))
