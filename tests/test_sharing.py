"""Memory sharing and preemption, end to end on a tiny model: parallel sampling and best_of,
copy-on-write, prefix caching (hits, collisions, eviction), and preemption by swap and by
recomputation, each checked against an unconstrained run. Every test ends with no leaked block."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import assert_no_leaks

from pagedllm import LLM, SamplingParams
from pagedllm.config import CacheConfig
from pagedllm.models.loader import load_model_config
from pagedllm.worker.cache_engine import CacheEngine

BS = 4


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=llama_dir, num_kv_blocks=256, block_size=BS)


def _random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 384) for _ in range(length)] for length in lengths]


def _token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def run_and_watch(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list, dict]:
    """generate(), one step at a time, recording the peaks of the engine's statistics."""
    engine = llm.llm_engine
    request_ids = []
    for prompt, p in zip(prompts, params):
        request_ids.append(engine.next_request_id())
        engine.add_request(request_ids[-1], prompt, p)
    finished = {}
    peaks: dict[str, int] = {"cpu_blocks_used": 0, "gpu_blocks_used": 0, "blocks_saved_by_sharing": 0}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        stats = engine.get_stats()
        for key in peaks:
            peaks[key] = max(peaks[key], stats[key])
    return [finished[rid] for rid in request_ids], peaks


# ------------------------------------------------------------------ parallel sampling, best_of, CoW


def test_best_of_returns_the_best_n_and_is_reproducible(llm):
    prompt = _random_prompts([9])[0]
    every = SamplingParams(n=4, best_of=4, temperature=1.0, seed=21, max_tokens=10, ignore_eos=True)
    best = SamplingParams(n=2, best_of=4, temperature=1.0, seed=21, max_tokens=10, ignore_eos=True)
    candidates = llm.generate([prompt], every, use_tqdm=False)[0].outputs
    assert len({tuple(c.token_ids) for c in candidates}) > 1  # the samples really differ
    ranked = sorted(candidates, key=lambda c: c.cumulative_logprob, reverse=True)
    # Same seed, same candidates; best_of keeps the n with the highest cumulative logprob.
    chosen = llm.generate([prompt], best, use_tqdm=False)[0].outputs
    assert [c.token_ids for c in chosen] == [c.token_ids for c in ranked[:2]]
    # Independent of whatever else is in the batch (unseeded sampling, greedy, beams).
    others = _random_prompts([5, 13, 6], seed=3)
    batch = llm.generate(
        [others[0], prompt, others[1], others[2]],
        [
            SamplingParams(n=3, temperature=0.8, max_tokens=8, ignore_eos=True),
            best,
            SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
            SamplingParams(use_beam_search=True, best_of=3, max_tokens=6, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert [c.token_ids for c in batch[1].outputs] == [c.token_ids for c in chosen]
    assert_no_leaks(llm)


def test_parallel_sampling_copy_on_write_is_exact(llm):
    engine = llm.llm_engine
    before = engine.get_stats()["num_cow_copies"]
    # 7 prompt tokens in blocks of 4: the second block is shared, partly filled, by 3 samples.
    # The first decode writes into it: 2 copies (the last holder writes in place), then every
    # sample fills blocks of its own.
    prompt = _random_prompts([7])[0]
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=9, ignore_eos=True)
    outputs, peaks = run_and_watch(llm, [prompt], [params])
    assert engine.get_stats()["num_cow_copies"] - before == 2
    assert peaks["blocks_saved_by_sharing"] >= 2 * 2  # 2 prompt blocks shared 3 ways, before any write
    assert len(outputs[0].outputs) == 3
    assert_no_leaks(llm)


def test_cache_engine_copies_and_swaps_every_layer(llama_dir):
    model_config = load_model_config(llama_dir, "float32")
    cache = CacheEngine(model_config, CacheConfig(block_size=BS), 8, 4, torch.device("cpu"), torch.float32)
    cache.gpu_pool.copy_(torch.randn_like(cache.gpu_pool))
    original = cache.gpu_pool.clone()
    cache.copy_blocks([(1, 5), (2, 6)])
    assert torch.equal(cache.gpu_pool[:, :, 5], original[:, :, 1])
    assert torch.equal(cache.gpu_pool[:, :, 6], original[:, :, 2])
    assert torch.equal(cache.gpu_pool[:, :, :5], original[:, :, :5])
    cache.swap_out([(3, 0), (4, 2)])
    cache.gpu_pool.zero_()
    cache.swap_in([(2, 7), (0, 0)])
    assert torch.equal(cache.gpu_pool[:, :, 7], original[:, :, 4])
    assert torch.equal(cache.gpu_pool[:, :, 0], original[:, :, 3])
    for layer, (k_cache, v_cache) in enumerate(cache.kv_caches):  # the views the model reads see it too
        assert torch.equal(k_cache[7], original[layer, 0, 4]) and torch.equal(v_cache[7], original[layer, 1, 4])


# ------------------------------------------------------------------------------- prefix caching


def test_shared_prefix_is_computed_once(llama_dir):
    prefix = _random_prompts([5 * BS], seed=7)[0]  # 5 full blocks
    suffixes = _random_prompts([3, 6, 9], seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cached = LLM(model=llama_dir, num_kv_blocks=128, block_size=BS)
    engine = cached.llm_engine
    got = []
    for i, suffix in enumerate(suffixes):
        before = engine.get_stats()
        got.append(cached.generate([prefix + suffix], params, use_tqdm=False)[0].outputs[0].token_ids)
        after = engine.get_stats()
        hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
        computed = after["prompt_tokens"] - before["prompt_tokens"]
        # The first request computes everything; later ones only their suffix.
        assert hits == (0 if i == 0 else 5 * BS)
        assert computed == len(prefix) + len(suffix) - hits
    assert_no_leaks(cached)
    plain = LLM(model=llama_dir, num_kv_blocks=128, block_size=BS, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in plain.generate([prefix + s for s in suffixes], params, use_tqdm=False)]
    assert got == expected
    assert plain.llm_engine.get_stats()["prefix_cache_hit_tokens"] == 0
    assert_no_leaks(plain)


def test_hash_collisions_never_give_wrong_output(llama_dir):
    prompts = _random_prompts([10, 13, 17, 9], seed=5)
    # The same first block for two of them: with one hash for every block, only the first cached
    # block owns it, every other promotion or lookup collides and must be a miss, never a wrong hit.
    prompts[1] = prompts[0][:8] + prompts[1][8:]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    plain = LLM(model=llama_dir, num_kv_blocks=128, block_size=BS, enable_prefix_caching=False)
    expected = [plain.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    colliding = LLM(model=llama_dir, num_kv_blocks=128, block_size=BS)
    colliding.llm_engine.scheduler.block_manager.gpu_allocator.hash_fn = lambda parent_hash, token_ids: 42
    got = [colliding.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert got == expected
    stats = colliding.llm_engine.get_stats()
    assert stats["prefix_cache_hash_collisions"] > 0
    assert stats["prefix_cache_hit_tokens"] == BS  # prompts[1] still hits prompts[0]'s first block
    assert_no_leaks(colliding)


def test_eviction_under_pressure_keeps_outputs(llama_dir):
    # Ten requests that pairwise share a prefix, through a pool that holds only a few at a time.
    bases = _random_prompts([12] * 5, seed=9)
    tails = _random_prompts([3] * 10, seed=10)
    prompts = [bases[i // 2] + tails[i] for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    roomy = LLM(model=llama_dir, num_kv_blocks=256, block_size=BS, enable_prefix_caching=False)
    expected = _token_ids(roomy.generate(prompts, params, use_tqdm=False))
    tight = LLM(model=llama_dir, num_kv_blocks=24, block_size=BS)
    got = _token_ids(tight.generate(prompts, params, use_tqdm=False))
    assert got == expected
    stats = tight.llm_engine.get_stats()
    assert stats["prefix_cache_evictions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert_no_leaks(tight)


# ----------------------------------------------------------------------------------- preemption

MIXED_LENGTHS = [7, 16, 17, 30, 11, 23]


def _mixed_params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [
        greedy,
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True),
        SamplingParams(use_beam_search=True, best_of=2, max_tokens=24, ignore_eos=True),
        greedy,
        SamplingParams(n=3, best_of=3, temperature=0.9, seed=4, max_tokens=20, ignore_eos=True),
        SamplingParams(use_beam_search=True, best_of=3, n=2, max_tokens=20, ignore_eos=True),
    ]


@pytest.fixture(scope="module")
def unconstrained(llama_dir):
    roomy = LLM(model=llama_dir, num_kv_blocks=512, block_size=BS)
    outputs, _ = run_and_watch(roomy, _random_prompts(MIXED_LENGTHS, seed=2), _mixed_params())
    assert roomy.llm_engine.get_stats()["num_preempted"] == 0
    return _token_ids(outputs)


@pytest.mark.parametrize(
    "mode, swap_space, by_swap, by_recompute",
    [
        ("swap", "1MiB", True, False),
        ("auto", "1MiB", True, True),
        ("recompute", 0, False, True),
        ("swap", 4 * 2048, None, True),  # a CPU pool of 4 blocks: falls back to recomputation
    ],
)
def test_preemption_keeps_outputs(llama_dir, unconstrained, mode, swap_space, by_swap, by_recompute):
    tight = LLM(model=llama_dir, num_kv_blocks=48, block_size=BS, swap_space=swap_space, preemption_mode=mode)
    engine = tight.llm_engine
    outputs, peaks = run_and_watch(tight, _random_prompts(MIXED_LENGTHS, seed=2), _mixed_params())
    assert _token_ids(outputs) == unconstrained
    stats = engine.get_stats()
    if by_swap is not None:
        assert (stats["num_preempted_by_swap"] > 0) == by_swap
    if by_recompute is not None:
        assert (stats["num_preempted_by_recompute"] > 0) == by_recompute
    # The paper's bound: what is swapped out never exceeds the device pool (nor the CPU pool).
    assert peaks["cpu_blocks_used"] <= min(engine.num_gpu_blocks, engine.num_cpu_blocks)
    if stats["num_preempted_by_swap"]:
        assert stats["num_blocks_swapped_in"] == stats["num_blocks_swapped_out"] > 0
    assert_no_leaks(tight)
    assert stats["cpu_blocks_used"] == 0
