"""KV waste accounting (core/waste.py) on hand-built cases with known answers."""

from __future__ import annotations

import pytest

from pagedllm.core.block_manager import BlockSpaceManager
from pagedllm.core.policies import ContiguousBlockManager
from pagedllm.core.waste import CATEGORIES, WasteTracker
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 4


def _group(request_id: str, seq_id: int, prompt_len: int, output_len: int) -> SequenceGroup:
    seq = Sequence(seq_id, list(range(prompt_len)), BS)
    group = SequenceGroup(request_id, [seq], SamplingParams(max_tokens=output_len), 0.0)
    group.oracle_output_len = output_len
    return group


def _grow(manager, seq: Sequence) -> None:
    """One decode step's bookkeeping: the previous tokens are cached, one more is appended."""
    seq.num_computed_tokens = seq.get_len()
    seq.append_token(1, 0.0)
    manager.append_slots(seq)


def _check_sums_to_pool(summary: dict) -> None:
    assert sum(summary["slots"][name] for name in CATEGORIES) == pytest.approx(summary["pool_slots"])


def test_paged_only_the_last_block_wastes() -> None:
    manager = BlockSpaceManager(BS, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0, enable_prefix_caching=False)
    group = _group("a", 0, prompt_len=5, output_len=2)
    manager.allocate(group)
    seq = group.seqs[0]
    seq.status = SequenceStatus.RUNNING
    tracker = WasteTracker()
    tracker.observe(manager, [seq], None)  # 5 tokens in 2 blocks: 3 unfilled
    _grow(manager, seq)
    tracker.observe(manager, [seq], None)  # 6 tokens: 2 unfilled; the sequence ends at 6
    summary = tracker.summary()
    # Step 1: of the 3 unfilled slots, 1 (position 5) will be written: reserved 1, internal 2.
    # Step 2: both unfilled slots are never written: internal 2.
    assert summary["slots"] == pytest.approx({"token": 5.5, "reserved": 0.5, "internal": 2.0, "external": 0.0,
                                              "free": 24.0})
    assert summary["fraction_of_used"]["token"] == pytest.approx(5.5 / 8)
    _check_sums_to_pool(summary)


def test_paged_shared_partial_block_counts_once() -> None:
    manager = BlockSpaceManager(BS, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0, enable_prefix_caching=False)
    group = _group("a", 0, prompt_len=6, output_len=1)
    manager.allocate(group)
    parent = group.seqs[0]
    child = parent.fork(1)
    manager.fork(parent, child)
    tracker = WasteTracker()
    tracker.observe(manager, [parent, child], None)
    summary = tracker.summary()
    assert summary["slots"]["token"] == 6 and summary["slots"]["internal"] == 2  # 2 shared blocks, one tail


def test_contiguous_max_reservation_and_internal_fragmentation() -> None:
    manager = ContiguousBlockManager("contiguous-max", BS, num_gpu_blocks=8, max_model_len=16)
    group = _group("a", 0, prompt_len=5, output_len=2)
    manager.allocate(group)  # 16 slots = 4 blocks
    seq = group.seqs[0]
    seq.status = SequenceStatus.RUNNING
    tracker = WasteTracker()
    tracker.observe(manager, [seq], None, weight=1.0)
    _grow(manager, seq)
    tracker.observe(manager, [seq], None, weight=3.0)  # weights: time averages
    summary = tracker.summary()
    # Step 1 (w=1): 5 tokens, 11 unfilled of which 1 will be written -> reserved 1, internal 10.
    # Step 2 (w=3): 6 tokens, 10 unfilled, all internal.
    assert summary["slots"] == pytest.approx({
        "token": (5 + 3 * 6) / 4, "reserved": 1 / 4, "internal": 10.0, "external": 0.0, "free": 16.0})
    _check_sums_to_pool(summary)


def test_contiguous_external_fragmentation_for_the_head_request() -> None:
    manager = ContiguousBlockManager("contiguous-oracle", BS, num_gpu_blocks=8, max_model_len=32)
    running = []
    for i in range(2):
        group = _group(f"r{i}", i, prompt_len=10, output_len=3)  # 12 slots = 3 blocks, in a 4-block chunk
        manager.allocate(group)
        running += group.seqs
    head = _group("head", 5, prompt_len=6, output_len=3)  # 8 slots = 2 blocks
    assert manager.buddy.num_free == 2 and not manager.buddy.can_allocate(2)
    tracker = WasteTracker()
    tracker.observe(manager, running, head)
    summary = tracker.summary()
    assert summary["slots"]["external"] == 8 and summary["slots"]["free"] == 0  # 2 blocks free, both unusable
    tracker = WasteTracker()
    tracker.observe(manager, running, None)  # nobody waiting: free is just free
    assert tracker.summary()["slots"]["external"] == 0


def test_oracle_at_block_size_one_wastes_nothing() -> None:
    manager = ContiguousBlockManager("contiguous-oracle", 1, num_gpu_blocks=64, max_model_len=64)
    seq = Sequence(0, list(range(5)), 1)
    group = SequenceGroup("a", [seq], SamplingParams(max_tokens=3), 0.0)
    group.oracle_output_len = 3  # writes 5 + 3 - 1 = 7 slots
    manager.allocate(group)
    seq.status = SequenceStatus.RUNNING
    tracker = WasteTracker()
    for _ in range(3):
        tracker.observe(manager, [seq], None)
        if seq.get_output_len() < 2:
            _grow(manager, seq)
    summary = tracker.summary()
    assert summary["slots"]["internal"] == 0
    assert summary["slots"]["reserved"] == pytest.approx((2 + 1 + 0) / 3)


def test_scheduler_reports_waste_in_stats() -> None:
    from pagedllm.config import CacheConfig, SchedulerConfig
    from pagedllm.core.scheduler import Scheduler

    config = SchedulerConfig(max_model_len=32, kv_allocation="contiguous-max", track_kv_waste=True)
    scheduler = Scheduler(config, CacheConfig(block_size=BS, enable_prefix_caching=False), 16, 0)
    scheduler.add_seq_group(_group("a", 0, 5, 2))
    scheduler.schedule()
    waste = scheduler.get_stats()["kv_waste"]
    assert waste["observations"] == 1 and waste["slots"]["token"] == 5
    assert waste["fraction_of_used"]["token"] == pytest.approx(5 / 32)
