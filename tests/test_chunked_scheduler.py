"""The one-token-budget policy (chunked prefill), driven by the fake engine of tests/fake_engine.py."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.sequence import SequenceStatus
from tests.fake_engine import BS, FakeEngine, make_scheduler, outputs_of


def chunked(**kwargs) -> FakeEngine:
    return FakeEngine(make_scheduler(enable_chunked_prefill=True, **kwargs))


def test_decodes_first_then_a_long_prompt_in_chunks() -> None:
    engine = chunked(max_num_batched_tokens=10)
    a = engine.add("a", 3, max_tokens=20, arrival_time=1.0)
    b = engine.add("b", 3, max_tokens=20, arrival_time=2.0)
    engine.step()  # both prompts (6 tokens)
    long = engine.add("long", 30, max_tokens=2, arrival_time=3.0)
    out = engine.step()
    # Two decodes, then the rest of the budget for the new prompt's first chunk.
    assert out.scheduled_seq_groups == [a, b, long]
    assert out.num_scheduled_tokens == {a.seqs[0].seq_id: 1, b.seqs[0].seq_id: 1, long.seqs[0].seq_id: 8}
    seq = long.seqs[0]
    assert seq.status == SequenceStatus.RUNNING and seq.num_computed_tokens == 8 and not seq.output_token_ids
    assert engine.bm.has_blocks(seq)  # a partly computed prompt keeps its blocks
    for expected in (16, 24):
        engine.step()
        assert seq.num_computed_tokens == expected and not seq.output_token_ids
    out = engine.step()
    assert out.num_scheduled_tokens[seq.seq_id] == 6 and len(seq.output_token_ids) == 1  # last chunk samples
    engine.run()
    assert all(len(g.seqs[0].output_token_ids) == g.sampling_params.max_tokens for g in (a, b, long))


def test_prompt_longer_than_budget_is_admitted_up_to_max_model_len() -> None:
    engine = chunked(max_num_batched_tokens=5, max_model_len=64)
    ok = engine.add("ok", 40, max_tokens=3)
    too_long = engine.add("too_long", 70, max_tokens=3)
    engine.run()
    assert ok.seqs[0].status == SequenceStatus.FINISHED_LENGTH_CAPPED and ok.error is None
    assert too_long.seqs[0].status == SequenceStatus.FINISHED_IGNORED and "max_model_len=64" in too_long.error
    assert all(out.num_batched_tokens <= 5 for out in engine.history)


def test_samples_fork_when_the_last_chunk_is_done() -> None:
    engine = chunked(max_num_batched_tokens=4)
    group = engine.add("n3", 10, max_tokens=3, n=3)
    for computed in (4, 8):
        engine.step()
        assert len(group.seqs) == 1 and group.seqs[0].num_computed_tokens == computed
    engine.step()
    assert len(group.seqs) == 3 and all(len(seq.output_token_ids) == 1 for seq in group.seqs)
    # The children share the parent's blocks: the prompt's two full blocks and its partial one.
    tables = [engine.bm.get_block_table(seq) for seq in group.seqs]
    assert tables[0] == tables[1] == tables[2]
    engine.run()


def test_prefix_hits_skip_their_tokens() -> None:
    engine = chunked(max_num_batched_tokens=6)
    system = list(range(500, 516))  # 4 blocks
    engine.add("first", system + [1, 2], max_tokens=2)
    engine.run()
    second = engine.add("second", system + [3, 4], max_tokens=2)
    out = engine.step()
    assert out.num_scheduled_tokens == {second.seqs[0].seq_id: 2}  # 16 tokens came from the cache
    engine.run()
    assert second.num_cached_tokens == 16


def test_preempted_mid_prompt_group_resumes_with_its_cached_chunks() -> None:
    engine = chunked(num_gpu_blocks=12, max_num_batched_tokens=8, preemption_mode="recompute")
    old = engine.add("old", 14, max_tokens=24, arrival_time=1.0)
    new = engine.add("new", list(range(300, 330)), max_tokens=4, arrival_time=2.0)
    preempted_mid_prompt = False
    while engine.scheduler.has_unfinished_seqs():
        computed = new.seqs[0].num_computed_tokens
        out = engine.step()
        if out.num_preempted and 0 < computed < new.seqs[0].prompt_len and not new.seqs[0].output_token_ids:
            preempted_mid_prompt = True
    assert preempted_mid_prompt and old.num_preemptions == 0
    reference = chunked(num_gpu_blocks=200, max_num_batched_tokens=8)
    reference.add("old", 14, max_tokens=24, arrival_time=1.0)
    reference.add("new", list(range(300, 330)), max_tokens=4, arrival_time=2.0)
    reference.run()
    assert outputs_of(engine) == outputs_of(reference)
    # Its computed full blocks went to the prefix cache: re-admission skipped them.
    assert engine.scheduler.get_stats()["prefix_cache_hit_tokens"] > 0


def test_beam_groups_decode_together_in_chunked_steps() -> None:
    engine = chunked(max_num_batched_tokens=5)
    group = engine.add("beam", 9, max_tokens=4, n=2, use_beam_search=True)
    engine.add("other", 9, max_tokens=4)
    engine.run()
    assert [len(seq.output_token_ids) for seq in group.seqs] == [4]  # scripted beams: no forks
    decode_steps = [out for out in engine.history if group in out.scheduled_seq_groups]
    assert all(out.num_batched_tokens <= 5 for out in decode_steps)


def test_contiguous_policies_and_request_batching_with_chunks() -> None:
    results = []
    for kv_allocation, batching in [("paged", "iteration"), ("contiguous-max", "iteration"),
                                    ("contiguous-oracle", "request")]:
        engine = chunked(num_gpu_blocks=128, max_num_batched_tokens=6, max_model_len=64,
                         kv_allocation=kv_allocation, batching=batching, enable_prefix_caching=False)
        groups = [engine.add(f"r{i}", 5 + 3 * i, max_tokens=6, n=1 + i % 2, arrival_time=float(i)) for i in range(5)]
        first = engine.step()
        if batching == "request":  # the whole batch is admitted at once, prompts then chunked
            assert all(group.seqs[0].status == SequenceStatus.RUNNING for group in groups)
            assert first.num_batched_tokens <= 6
        engine.run()
        assert all(out.num_batched_tokens <= 6 for out in engine.history)
        results.append(outputs_of(engine))
    assert results[0] == results[1] == results[2]


def test_long_prefill_threshold_caps_each_prompt_and_shares_the_budget() -> None:
    engine = chunked(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    a = engine.add("a", 20, max_tokens=2, arrival_time=1.0)
    b = engine.add("b", 5, max_tokens=2, arrival_time=2.0)
    c = engine.add("c", 30, max_tokens=2, arrival_time=3.0)
    out = engine.step()
    # Every waiting prompt is admitted at once, each with at most 8 of its tokens.
    assert out.scheduled_seq_groups == [a, b, c]
    assert out.num_scheduled_tokens == {a.seqs[0].seq_id: 8, b.seqs[0].seq_id: 5, c.seqs[0].seq_id: 8}
    out = engine.step()
    # b decodes first; the partial prompts continue in arrival order, 8 tokens each at most.
    assert out.num_scheduled_tokens == {b.seqs[0].seq_id: 1, a.seqs[0].seq_id: 8, c.seqs[0].seq_id: 8}
    engine.run()
    assert all(len(g.seqs[0].output_token_ids) == 2 for g in (a, b, c))
    assert all(out.num_batched_tokens <= 64 for out in engine.history)


def test_long_prefill_threshold_below_a_groups_size_still_finishes_its_prompt() -> None:
    # A preempted group of three samples recomputes its sequences one token per step; their last
    # tokens are then computed together, as a decode.
    engine = chunked(max_num_batched_tokens=16, long_prefill_token_threshold=1, num_gpu_blocks=16)
    other = engine.add("other", 6, max_tokens=12, arrival_time=1.0)
    group = engine.add("n3", 6, max_tokens=12, n=3, arrival_time=2.0)  # the newest: preempted first
    engine.run()
    assert group.num_preemptions >= 1
    assert all(len(seq.output_token_ids) == 12 for seq in group.seqs) and len(group.seqs) == 3
    assert len(other.seqs[0].output_token_ids) == 12


def test_long_prefill_threshold_is_validated() -> None:
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="long_prompt_chunk_tokens"):
        SchedulerConfig(long_prompt_chunk_tokens=-1)
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        SchedulerConfig(max_prefill_tokens_while_decoding=-1)


def test_prompts_within_the_budget_run_whole_longer_ones_in_capped_chunks() -> None:
    engine = chunked(max_num_batched_tokens=32, long_prompt_chunk_tokens=8, max_model_len=512,
                     enable_prefix_caching=False)
    a = engine.add("a", 30, max_tokens=4, arrival_time=1.0)
    out = engine.step()
    assert out.num_scheduled_tokens == {a.seqs[0].seq_id: 30}  # fits the budget: one step
    long = engine.add("long", 40, max_tokens=2, arrival_time=2.0)
    short = engine.add("short", 20, max_tokens=2, arrival_time=3.0)
    out = engine.step()
    # a decodes; the long prompt (40 > 32) gets 8 tokens; the short one the rest of the budget.
    assert out.num_scheduled_tokens == {a.seqs[0].seq_id: 1, long.seqs[0].seq_id: 8, short.seqs[0].seq_id: 20}
    out = engine.step()
    assert out.num_scheduled_tokens[long.seqs[0].seq_id] == 8
    engine.run()
    assert all(out.num_batched_tokens <= 32 for out in engine.history)
    assert len(long.seqs[0].output_token_ids) == 2 and len(short.seqs[0].output_token_ids) == 2


def test_prompt_tokens_are_capped_only_in_steps_that_decode() -> None:
    engine = chunked(max_num_batched_tokens=32, max_prefill_tokens_while_decoding=8, max_model_len=512,
                     enable_prefix_caching=False)
    a = engine.add("a", 30, max_tokens=4, arrival_time=1.0)
    out = engine.step()
    assert out.num_scheduled_tokens == {a.seqs[0].seq_id: 30} and out.num_decode_tokens == 0  # idle: whole
    b = engine.add("b", 12, max_tokens=2, arrival_time=2.0)
    c = engine.add("c", 3, max_tokens=2, arrival_time=3.0)
    out = engine.step()
    # a decodes, so b and c share 8 prompt tokens, first come first served (b stops short of its end).
    assert out.num_scheduled_tokens == {a.seqs[0].seq_id: 1, b.seqs[0].seq_id: 8}
    assert out.num_decode_tokens == 1 and out.num_batched_tokens == 9
    out = engine.step()
    assert out.num_scheduled_tokens == {a.seqs[0].seq_id: 1, b.seqs[0].seq_id: 4, c.seqs[0].seq_id: 3}
    engine.run()
    assert all(len(g.seqs[0].output_token_ids) == g.sampling_params.max_tokens for g in (a, b, c))
    assert all(out.num_batched_tokens - out.num_decode_tokens <= 8 for out in engine.history if out.num_decode_tokens)
    assert engine.bm.all_free()


# ------------------------------------------------------------------------------ property test


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(
        # (arrival step, prompt length, max_tokens, n)
        st.tuples(st.integers(0, 12), st.sampled_from([1, 5, 12, 12, 12, 23]), st.integers(1, 10), st.integers(1, 3)),
        min_size=1,
        max_size=10,
    ),
    budget=st.integers(3, 40),
    extra_blocks=st.integers(0, 30),
    num_cpu_blocks=st.integers(0, 24),
    mode=st.sampled_from(["recompute", "swap", "auto"]),
    caching=st.booleans(),
    threshold=st.sampled_from([0, 0, 1, 4, 9]),
    long_chunk=st.sampled_from([0, 0, 1, 3, 8]),
    decoding_cap=st.sampled_from([0, 0, 1, 5, 16]),
)
def test_property_budget_pool_completion_and_fcfs(requests, budget, extra_blocks, num_cpu_blocks, mode, caching,
                                                   threshold, long_chunk, decoding_cap):
    """Random arrivals, lengths and budgets: no step exceeds the budget or the pool, every request
    finishes with the outputs of an unconstrained run, no block leaks, and among prompts of equal
    length the first tokens come in arrival order."""
    # Enough blocks for any one request alone at its full length, so that none can be refused.
    need = max(n * -(-(prompt + max_tokens) // BS) for _, prompt, max_tokens, n in requests)
    num_gpu_blocks = need + extra_blocks

    def run(engine: FakeEngine) -> FakeEngine:
        pending = sorted(enumerate(requests), key=lambda item: (item[1][0], item[0]))
        step = 0
        while pending or engine.scheduler.has_unfinished_seqs():
            while pending and pending[0][1][0] <= step:
                i, (_, prompt, max_tokens, n) = pending.pop(0)
                engine.add(f"r{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + prompt)), max_tokens=max_tokens, n=n,
                           arrival_time=float(step * 100 + i))
            engine.step()
            step += 1
            assert step < 5000, "stuck"
        assert engine.bm.all_free(), "blocks leaked"
        return engine

    engine = run(chunked(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, max_num_seqs=8,
                         max_num_batched_tokens=budget, preemption_mode=mode, enable_prefix_caching=caching,
                         long_prefill_token_threshold=threshold, long_prompt_chunk_tokens=long_chunk,
                         max_prefill_tokens_while_decoding=decoding_cap))
    reference = run(chunked(num_gpu_blocks=4000, max_num_seqs=64, max_num_batched_tokens=4096))
    assert not engine.ignored and set(engine.finished) == {f"r{i}" for i in range(len(requests))}
    assert outputs_of(engine) == outputs_of(reference)
    for out in engine.history:
        assert out.num_batched_tokens <= budget
        if decoding_cap and out.num_decode_tokens:
            assert out.num_batched_tokens - out.num_decode_tokens <= decoding_cap
        for group in out.scheduled_seq_groups:
            # No group computes more than the threshold, nor one whose prompt alone is too long for
            # the budget more than long_chunk (decoding, one token per sequence).
            tokens = [out.num_scheduled_tokens.get(seq.seq_id, 0) for seq in group.seqs]
            decode = sum(1 for t in tokens if t)
            if threshold:
                assert sum(tokens) <= max(threshold, decode)
            if long_chunk and group.seqs[0].prompt_len > budget:
                assert sum(tokens) <= max(long_chunk, decode)
    # FCFS: equal prompt lengths, arrival order (= the order of ids within an arrival step).
    order = sorted(range(len(requests)), key=lambda i: (requests[i][0], i))
    for a_pos, a in enumerate(order):
        for b in order[a_pos + 1 :]:
            if requests[a][1] == requests[b][1]:
                assert engine.first_token_step[f"r{a}"] <= engine.first_token_step[f"r{b}"]
