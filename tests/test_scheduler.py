"""Scheduler policy with whole-prompt steps (chunked prefill off, the paper's policy), driven by
the fake engine of tests/fake_engine.py. The one-budget policy is in test_chunked_scheduler.py;
the randomized workload here runs both.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.core import Scheduler
from pagedllm.sequence import SequenceGroup, SequenceStatus
from tests.fake_engine import FakeEngine, make_scheduler, outputs_of

# ----------------------------------------------------------------------------- basic policy


def test_fcfs_prefill_then_decode() -> None:
    engine = FakeEngine(make_scheduler())
    groups = [engine.add(f"r{i}", 5 + i, max_tokens=3, arrival_time=float(i)) for i in range(3)]
    out = engine.step()
    assert engine.is_prefill(out) and out.scheduled_seq_groups == groups
    assert out.num_batched_tokens == 5 + 6 + 7
    assert all(g.metrics.first_scheduled_time is not None and g.metrics.time_in_queue >= 0 for g in groups)
    engine.add("late", 4, max_tokens=3, arrival_time=10.0)
    out = engine.step()
    assert engine.is_prefill(out) and [g.request_id for g in out.scheduled_seq_groups] == ["late"]
    out = engine.step()
    assert not engine.is_prefill(out) and out.num_batched_tokens == 4  # one token per running sequence
    assert [g.request_id for g in out.scheduled_seq_groups] == ["r0", "r1", "r2", "late"]
    engine.run()
    assert all(len(g.seqs[0].output_token_ids) == 3 for g in engine.finished.values())


def test_budgets_are_respected() -> None:
    engine = FakeEngine(make_scheduler(max_num_seqs=2, max_num_batched_tokens=20))
    for i in range(5):
        engine.add(f"r{i}", 8, max_tokens=5)
    out = engine.step()
    assert [g.request_id for g in out.scheduled_seq_groups] == ["r0", "r1"]  # max_num_seqs
    while engine.scheduler.has_unfinished_seqs():
        out = engine.step()
        assert out.num_batched_tokens <= 20
        assert sum(g.num_seqs(SequenceStatus.RUNNING) for g in engine.scheduler.running) <= 2

    engine = FakeEngine(make_scheduler(max_num_seqs=16, max_num_batched_tokens=20))
    for i in range(3):
        engine.add(f"r{i}", 8, max_tokens=2)
    out = engine.step()
    assert [g.request_id for g in out.scheduled_seq_groups] == ["r0", "r1"]  # 16 tokens; 24 > 20
    engine.run()


def test_best_of_counts_against_max_num_seqs() -> None:
    engine = FakeEngine(make_scheduler(max_num_seqs=4))
    engine.add("a", 4, n=3)
    engine.add("b", 4, n=2)
    out = engine.step()
    assert [g.request_id for g in out.scheduled_seq_groups] == ["a"]
    engine.run()
    assert all(len(seq.output_token_ids) == 4 for seq in engine.finished["b"].seqs)


def test_watermark_keeps_blocks_free_at_admission() -> None:
    engine = FakeEngine(make_scheduler(num_gpu_blocks=20, watermark=0.25))  # 5 blocks kept free
    for i in range(4):
        engine.add(f"r{i}", 16, max_tokens=2)  # 4 blocks each
    out = engine.step()
    assert len(out.scheduled_seq_groups) == 3  # a 4th would leave 4 < 5 free blocks
    assert engine.bm.get_num_free_gpu_blocks() >= 5
    engine.run()


# ------------------------------------------------------------------------------- preemption


def test_recompute_preempts_newest_and_resets() -> None:
    def build(num_gpu_blocks: int) -> tuple[FakeEngine, list[SequenceGroup]]:
        scheduler = make_scheduler(
            num_gpu_blocks=num_gpu_blocks, max_num_seqs=3, preemption_mode="recompute", enable_prefix_caching=False
        )
        engine = FakeEngine(scheduler)
        # Three running groups of 2 blocks each fill a 6-block pool; a 4th waits (max_num_seqs).
        # The oldest needs a 3rd block first, while both others are still running.
        groups = [
            engine.add(name, prompt_len, max_tokens=12, arrival_time=float(i))
            for i, (name, prompt_len) in enumerate(zip("omnq", (7, 5, 5, 5)))
        ]
        return engine, groups

    engine, (old, mid, new, queued) = build(6)
    engine.step()
    preempting = None
    for _ in range(40):
        out = engine.step()
        if out.num_preempted:
            preempting = out
            break
    assert preempting is not None
    assert preempting.num_preempted == preempting.num_preempted_by_recompute == 1
    assert not preempting.blocks_to_swap_out
    assert list(engine.scheduler.waiting) == [new, queued]  # the newest, back at the front
    assert new.seqs[0].status == SequenceStatus.WAITING and new.seqs[0].num_computed_tokens == 0
    assert preempting.scheduled_seq_groups == [old, mid]
    assert not engine.bm.has_blocks(new.seqs[0])
    engine.run()
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    assert engine.scheduler.get_stats()["num_preempted_by_recompute"] >= 1
    reference, _ = build(64)
    reference.run()
    assert outputs_of(engine) == outputs_of(reference)


def test_recompute_reuses_prefix_cache() -> None:
    engine = FakeEngine(make_scheduler(num_gpu_blocks=6, preemption_mode="recompute", enable_prefix_caching=True))
    engine.add("old", 8, max_tokens=12, arrival_time=1.0)
    new = engine.add("new", 8, max_tokens=12, arrival_time=2.0)
    recomputed_tokens = []
    while engine.scheduler.has_unfinished_seqs():
        readmitted = new in engine.scheduler.waiting and new.num_preemptions
        out = engine.step()
        if readmitted and new in out.scheduled_seq_groups:
            recomputed_tokens.append((out.num_batched_tokens, new.seqs[0].get_len() - 1))
    assert engine.bm.all_free()
    assert recomputed_tokens
    # At least one re-prefill mapped its own cached blocks instead of recomputing everything.
    assert any(tokens < length for tokens, length in recomputed_tokens)


def test_swap_preemption_round_trip() -> None:
    engine = FakeEngine(make_scheduler(num_gpu_blocks=16, num_cpu_blocks=32, preemption_mode="swap"))
    engine.add("a", 6, max_tokens=16, n=2, arrival_time=1.0)
    b = engine.add("b", 6, max_tokens=16, n=2, arrival_time=2.0)
    swapped_out = swapped_in = False
    while engine.scheduler.has_unfinished_seqs():
        out = engine.step()
        if out.blocks_to_swap_out:
            swapped_out = True
            assert out.num_preempted_by_swap == 1
            assert b in engine.scheduler.swapped  # the newest group
            assert all(seq.status == SequenceStatus.SWAPPED for seq in b.get_unfinished_seqs())
            assert not engine.scheduler.waiting
        if out.blocks_to_swap_in:
            swapped_in = True
            assert b in out.scheduled_seq_groups
    assert swapped_out and swapped_in
    stats = engine.scheduler.get_stats()
    assert stats["num_preempted_by_swap"] >= 1 and stats["num_blocks_swapped_in"] == stats["num_blocks_swapped_out"]
    reference = FakeEngine(make_scheduler(num_gpu_blocks=64))
    reference.add("a", 6, max_tokens=16, n=2, arrival_time=1.0)
    reference.add("b", 6, max_tokens=16, n=2, arrival_time=2.0)
    reference.run()
    assert outputs_of(engine) == outputs_of(reference)


def test_swap_falls_back_to_recompute_without_cpu_space() -> None:
    engine = FakeEngine(make_scheduler(num_gpu_blocks=6, num_cpu_blocks=0, preemption_mode="swap"))
    engine.add("a", 8, max_tokens=12)
    engine.add("b", 8, max_tokens=12)
    engine.run()
    stats = engine.scheduler.get_stats()
    assert stats["num_preempted_by_recompute"] >= 1 and stats["num_preempted_by_swap"] == 0


def test_auto_mode_swaps_multi_sample_groups_and_recomputes_single() -> None:
    engine = FakeEngine(make_scheduler(num_gpu_blocks=16, num_cpu_blocks=32, preemption_mode="auto"))
    engine.add("a", 6, max_tokens=16, n=2, arrival_time=1.0)
    engine.add("b", 6, max_tokens=16, n=2, arrival_time=2.0)
    engine.run()
    assert engine.scheduler.num_preempted_by_swap >= 1
    engine = FakeEngine(make_scheduler(num_gpu_blocks=6, num_cpu_blocks=32, preemption_mode="auto"))
    engine.add("a", 8, max_tokens=12)
    engine.add("b", 8, max_tokens=12)
    engine.run()
    assert engine.scheduler.num_preempted_by_recompute >= 1 and engine.scheduler.num_preempted_by_swap == 0


def test_swapped_groups_resume_before_new_requests() -> None:
    engine = FakeEngine(make_scheduler(num_gpu_blocks=16, num_cpu_blocks=32, preemption_mode="swap"))
    engine.add("a", 6, max_tokens=16, n=2, arrival_time=1.0)
    b = engine.add("b", 6, max_tokens=16, n=2, arrival_time=2.0)
    while not engine.scheduler.swapped:
        engine.step()
    late = engine.add("late", 2, max_tokens=2, arrival_time=3.0)
    while engine.scheduler.swapped:
        out = engine.step()
        assert late not in out.scheduled_seq_groups  # no admission while anything is swapped
    assert b.seqs[0].status == SequenceStatus.RUNNING
    engine.run()
    assert b.metrics.first_scheduled_time <= late.metrics.first_scheduled_time


def test_group_outgrowing_whole_pool_is_finished_not_stuck() -> None:
    engine = FakeEngine(make_scheduler(num_gpu_blocks=3, preemption_mode="recompute"))
    group = engine.add("long", 10, max_tokens=100)
    engine.run(max_steps=50)
    assert group.is_finished() and group.error and "whole pool of 3 blocks" in group.error
    assert group.seqs[0].status == SequenceStatus.FINISHED_LENGTH_CAPPED
    assert "long" in engine.ignored
    # It used every slot of the pool: 12 tokens cached, plus the last sampled one.
    assert group.seqs[0].get_len() == 13


# ---------------------------------------------------------------------- never-fitting requests


@pytest.mark.parametrize(
    ("kwargs", "prompt", "n", "needle"),
    [
        ({"max_model_len": 16}, 20, 1, "20 tokens, more than max_model_len=16"),
        ({"num_gpu_blocks": 4}, 20, 1, "needs 5 KV-cache blocks of 4 tokens, but the whole pool has 4"),
        ({"max_num_batched_tokens": 16}, 20, 1, "20 tokens in one prefill step, more than max_num_batched_tokens=16"),
        ({"max_num_batched_tokens": 2, "enable_chunked_prefill": True}, 4, 3, "decodes 3 sequences per step"),
        ({"max_num_seqs": 2}, 4, 3, "needs 3 sequences"),
    ],
)
def test_never_fitting_request_is_ignored_with_message(kwargs: dict, prompt: int, n: int, needle: str) -> None:
    engine = FakeEngine(make_scheduler(**kwargs))
    bad = engine.add("bad", prompt, n=n)
    good = engine.add("good", 4, max_tokens=2)
    out = engine.step()
    assert out.ignored_seq_groups == [bad]
    assert out.scheduled_seq_groups == [good]  # the queue moves on in the same step
    assert bad.seqs[0].status == SequenceStatus.FINISHED_IGNORED
    assert needle in bad.error
    engine.run()
    assert "good" in engine.finished


# ------------------------------------------------------------------------------------- abort


def test_abort_from_every_queue_frees_everything() -> None:
    engine = FakeEngine(make_scheduler(num_gpu_blocks=16, num_cpu_blocks=32, preemption_mode="swap"))
    engine.add("a", 6, max_tokens=16, n=2, arrival_time=1.0)
    engine.add("b", 6, max_tokens=16, n=2, arrival_time=2.0)
    engine.add("c", 6, max_tokens=16, arrival_time=3.0)
    while not engine.scheduler.swapped:
        engine.step()
    engine.add("d", 6, max_tokens=16, arrival_time=4.0)
    scheduler = engine.scheduler
    assert scheduler.running and scheduler.swapped and scheduler.waiting
    groups = list(scheduler.running) + list(scheduler.swapped) + list(scheduler.waiting)
    scheduler.abort_seq_group("nonexistent")
    scheduler.abort_seq_group(scheduler.swapped[0].request_id)
    assert not scheduler.swapped
    scheduler.abort_seq_group([g.request_id for g in groups])
    assert not scheduler.has_unfinished_seqs() and scheduler.get_num_unfinished_seq_groups() == 0
    assert all(seq.status == SequenceStatus.FINISHED_ABORTED for g in groups for seq in g.seqs)
    assert engine.bm.all_free()
    assert scheduler.schedule().is_empty()


# ------------------------------------------------------------------------------ shared prefix


def test_shared_prefix_is_computed_once() -> None:
    engine = FakeEngine(make_scheduler(num_gpu_blocks=64))
    system = list(range(500, 516))  # a 16-token system prompt: 4 blocks
    engine.add("first", system + [1, 2], max_tokens=2)
    engine.step()
    engine.add("second", system + [3, 4], max_tokens=2)
    out = engine.step()
    assert engine.is_prefill(out) and out.num_batched_tokens == 2  # 16 tokens came from the cache
    engine.run()
    assert engine.scheduler.get_stats()["prefix_cache_hit_tokens"] == 16


# ------------------------------------------------------------------------ randomized workload


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(1, 3), st.sampled_from([0, 1, 2])),
        min_size=1,
        max_size=8,
    ),
    num_gpu_blocks=st.integers(8, 24),
    num_cpu_blocks=st.integers(0, 24),
    mode=st.sampled_from(["recompute", "swap", "auto"]),
    caching=st.booleans(),
    watermark=st.sampled_from([0.0, 0.1]),
    chunked=st.booleans(),
)
def test_random_workloads_finish_with_reference_outputs(
    requests, num_gpu_blocks, num_cpu_blocks, mode, caching, watermark, chunked
) -> None:
    def build(scheduler: Scheduler) -> FakeEngine:
        engine = FakeEngine(scheduler)
        for i, (prompt_len, max_tokens, n, prefix) in enumerate(requests):
            prompt = [7] * (4 * prefix) + list(range(1000 + i, 1000 + i + prompt_len))
            engine.add(f"r{i}", prompt, max_tokens=max_tokens, n=n, arrival_time=float(i))
        return engine

    engine = build(
        make_scheduler(
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            max_num_seqs=6,
            max_num_batched_tokens=40,
            watermark=watermark,
            preemption_mode=mode,
            enable_prefix_caching=caching,
            enable_chunked_prefill=chunked,
        )
    )
    engine.run(max_steps=2000)
    reference = build(make_scheduler(num_gpu_blocks=1000, max_num_seqs=64, max_num_batched_tokens=4096))
    reference.run()
    assert set(engine.finished) | set(engine.ignored) == {f"r{i}" for i in range(len(requests))}
    expected = outputs_of(reference)
    for rid, group in engine.finished.items():
        if group.error is None:
            assert [seq.output_token_ids for seq in group.seqs] == expected[rid]
        else:  # outgrew the pool: a prefix of the reference output
            for seq, ref in zip(group.seqs, expected[rid]):
                assert ref[: len(seq.output_token_ids)] == seq.output_token_ids
    for out in engine.history:
        oversized_recompute = not chunked and engine.is_prefill(out) and len(out.scheduled_seq_groups) == 1
        assert out.num_batched_tokens <= 40 or oversized_recompute


def test_schedule_is_fast_enough() -> None:
    engine = FakeEngine(make_scheduler(num_gpu_blocks=2000, max_num_seqs=128, max_num_batched_tokens=8192))
    engine.kv = None  # measure the scheduler, not the simulated cache
    for i in range(128):
        engine.add(f"r{i}", 60, max_tokens=16)
    start = time.perf_counter()
    engine.run()
    assert time.perf_counter() - start < 10
