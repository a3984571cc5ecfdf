"""KV memory-waste accounting: the paper's Figure 2, measured step by step on any policy.

At each observed step every token slot of the device pool (``num_gpu_blocks * block_size``
slots) is in exactly one category:

- **token**: holds (or is written in this step with) the K/V of a token of a sequence. A slot
  of a block shared by several sequences counts once.
- **reserved**: allocated to a sequence, not holding a token yet, but a token of that sequence
  *will* be written there before it ends (paging: the rest of the last block, when the sequence
  grows into it; contiguous: the part of the run the output will reach). Runs a contiguous
  policy holds for samples not forked yet (``best_of`` > 1) also count as reserved.
- **internal**: internal fragmentation, allocated to a sequence and never written by the time
  it ends (paging: the unused tail of its last block; contiguous: the run beyond its final
  length, e.g. everything past the true output under contiguous-max).
- **external**: external fragmentation, free, but unusable by the allocator for the request
  waiting at the head of the queue: free slots lying in contiguous free runs too small for
  its reservation. Zero when no request waits, and always zero under paging, where any free
  block serves any request.
- **free**: every other free slot.

Which allocated slots are reserved and which are internal depends on the future, so each
sequence's allocation is recorded per step and split once its final length is known (the
longest it ever was while holding blocks), in ``summary()``. A shared partial block (samples
before their first divergent write) is attributed to the sequence listed first.

Each observation has a weight (1 per step by default; the simulator uses the step's duration,
giving time averages). ``summary()`` returns the weighted mean slots per category, their
fractions of the pool, and their fractions of the *used* pool (every category but free), which
is the paper's percentage: token states / KV memory held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.interface import BlockManager
from pagedllm.sequence import Sequence, SequenceGroup

CATEGORIES = ("token", "reserved", "internal", "external", "free")


@dataclass(slots=True)
class _SeqRecord:
    """One sequence's allocation history, compressed: what the split needs and nothing more."""

    peak_len: int = 0
    weighted_unfilled: float = 0.0  # sum over steps of weight * allocated-but-unwritten slots
    weight_by_alloc_end: dict[int, float] = field(default_factory=dict)  # slots allocated -> weight


@dataclass(slots=True)
class StepUsage:
    """One step's slots, before the reserved / internal split (exposed for tests)."""

    total: int
    used: int
    unfilled_by_seq: list[tuple[int, int, int]]  # (seq_id, tokens now, slots allocated)
    reserved_now: int  # reserved whatever the future (spare runs)
    external: int


def measure_step(block_manager: BlockManager, seqs: list[Sequence], head: SequenceGroup | None) -> StepUsage:
    """The pool's slots at this moment, for any block manager."""
    bs = block_manager.block_size
    total = block_manager.num_gpu_blocks * bs
    used = block_manager.num_used_blocks() * bs
    external = block_manager.num_unusable_free_blocks(head) * bs if head is not None else 0
    return StepUsage(total, used, block_manager.slot_usage(seqs), block_manager.num_spare_blocks() * bs, external)


class WasteTracker:
    """Accumulates per-step KV slot usage; ``summary()`` gives the Figure 2 breakdown."""

    def __init__(self) -> None:
        self.total_weight = 0.0
        self.num_observations = 0
        self._sums = dict.fromkeys(("used", "unfilled", "reserved_now", "external", "total"), 0.0)
        self._seqs: dict[int, _SeqRecord] = {}
        self._last_weighted: tuple[StepUsage, float] | None = None

    def observe(
        self, block_manager: BlockManager, seqs: list[Sequence], head: SequenceGroup | None, weight: float = 1.0
    ) -> None:
        """Record the pool as ``seqs`` (the running sequences) and the waiting ``head`` see it now."""
        usage = measure_step(block_manager, seqs, head)
        self._add(usage, weight)
        self.num_observations += 1
        self._last_weighted = (usage, weight)

    def reweight_last(self, weight: float) -> None:
        """Change the weight of the latest observation (the simulator learns a step's duration after it)."""
        if self._last_weighted is None:
            return
        usage, old = self._last_weighted
        self._add(usage, weight - old)
        self._last_weighted = (usage, weight)

    def _add(self, usage: StepUsage, weight: float) -> None:
        if weight == 0:
            return
        self.total_weight += weight
        sums = self._sums
        sums["total"] += weight * usage.total
        sums["used"] += weight * usage.used
        sums["reserved_now"] += weight * usage.reserved_now
        sums["external"] += weight * usage.external
        for seq_id, tokens, slots in usage.unfilled_by_seq:
            record = self._seqs.get(seq_id)
            if record is None:
                record = self._seqs[seq_id] = _SeqRecord()
            record.peak_len = max(record.peak_len, tokens)
            record.weighted_unfilled += weight * (slots - tokens)
            record.weight_by_alloc_end[slots] = record.weight_by_alloc_end.get(slots, 0.0) + weight
            sums["unfilled"] += weight * (slots - tokens)

    def summary(self) -> dict:
        """Weighted mean slots per category and fractions (of the pool, and of the used pool)."""
        if self.total_weight <= 0:
            return {"observations": 0}
        internal = 0.0
        for record in self._seqs.values():
            internal += sum(w * max(0, end - record.peak_len) for end, w in record.weight_by_alloc_end.items())
        sums = self._sums
        reserved = sums["unfilled"] - internal + sums["reserved_now"]
        token = sums["used"] - sums["unfilled"] - sums["reserved_now"]
        free = sums["total"] - sums["used"] - sums["external"]
        weighted = {"token": token, "reserved": reserved, "internal": internal, "external": sums["external"],
                    "free": free}
        w = self.total_weight
        slots = {name: weighted[name] / w for name in CATEGORIES}
        pool = sums["total"] / w
        used = pool - slots["free"]
        return {
            "observations": self.num_observations,
            "pool_slots": pool,
            "slots": slots,
            "fraction_of_pool": {name: slots[name] / pool for name in CATEGORIES},
            "fraction_of_used": {name: (slots[name] / used if used else 0.0) for name in CATEGORIES if name != "free"},
        }
