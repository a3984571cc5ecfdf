"""End-to-end: greedy output equals transformers', batch invariance, forced preemption, bad input."""

from __future__ import annotations

import random

import pytest
from conftest import assert_no_leaks
from oracle import hf_greedy

from pagedllm import LLM, SamplingParams

NUM_NEW_TOKENS = 32


def _prompts(vocab_size: int, count: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 7, 16, 17, 30, 45, 64][:count]
    return [[rng.randrange(4, vocab_size) for _ in range(length)] for length in lengths]


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2", "opt"])
def test_greedy_equals_transformers(tiny_model_factory, kind):
    model_dir = tiny_model_factory(kind)
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=128, block_size=8)
    prompts = _prompts(llm.llm_engine.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    expected = hf_greedy(model_dir, prompts, NUM_NEW_TOKENS)  # checked not degenerate (oracle.py)
    assert ours == expected
    assert_no_leaks(llm)


def test_batch_invariance_greedy_and_seeded(llama_dir):
    llm = LLM(model=llama_dir, num_kv_blocks=128, block_size=8)
    prompts = _prompts(llm.llm_engine.vocab_size)
    for params in (
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True),
    ):
        alone = llm.generate([prompts[3]], params, use_tqdm=False)[0].outputs[0].token_ids
        batch = llm.generate(prompts, params, use_tqdm=False)[3].outputs[0].token_ids
        assert alone == batch
    assert_no_leaks(llm)


def test_forced_preemption_keeps_output(llama_dir):
    prompts = _prompts(384)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = LLM(model=llama_dir, num_kv_blocks=256, block_size=4)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    # 48 blocks of 4 slots cannot hold all 8 sequences at their full length at once.
    tight = LLM(model=llama_dir, num_kv_blocks=48, block_size=4)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    stats = tight.llm_engine.get_stats()
    assert stats["num_preempted"] > 0
    assert_no_leaks(tight)


def test_stop_strings_and_logprobs(llama_dir):
    llm = LLM(model=llama_dir, num_kv_blocks=128, block_size=8)
    prompt = _prompts(llm.llm_engine.vocab_size)[4]
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    text = full[0].outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, stop=stop, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    lp = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True),
                      use_tqdm=False)[0].outputs[0]
    assert len(lp.logprobs) == 5
    for token_id, step in zip(lp.token_ids, lp.logprobs):
        assert token_id in step and len(step) >= 3
        assert step[token_id] == max(step.values())  # greedy picks the most likely token
    assert abs(lp.cumulative_logprob - sum(s[t] for t, s in zip(lp.token_ids, lp.logprobs))) < 1e-4
    assert_no_leaks(llm)


def test_token_ids_only_without_detokenizing(llama_dir):
    """detokenize=False: the same token ids and logprobs, no text (vLLM's setting)."""
    llm = LLM(model=llama_dir, num_kv_blocks=128, block_size=8)
    prompt = _prompts(llm.llm_engine.vocab_size)[3]
    params = dict(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    with_text = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    ids_only = llm.generate([prompt], SamplingParams(**params, detokenize=False), use_tqdm=False)[0].outputs[0]
    assert with_text.text and ids_only.text == ""
    assert ids_only.token_ids == with_text.token_ids
    # (The second run reads its prompt from the prefix cache: logprobs agree to rounding.)
    for a, b in zip(ids_only.logprobs, with_text.logprobs, strict=True):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert_no_leaks(llm)


def test_parallel_sampling_best_of(llama_dir):
    llm = LLM(model=llama_dir, num_kv_blocks=128, block_size=8)
    prompt = _prompts(llm.llm_engine.vocab_size)[5]
    params = SamplingParams(n=2, best_of=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert len(first.outputs) == 2
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert first.outputs[0].cumulative_logprob >= first.outputs[1].cumulative_logprob
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ([5] * 600, SamplingParams(), "600"),
        ([10**9], SamplingParams(), "vocabulary"),
        ({"foo": 1}, SamplingParams(), "prompt"),
    ],
)
def test_bad_prompts(llama_dir, prompt, params, message):
    llm = _shared_llm(llama_dir)
    with pytest.raises(ValueError, match=message):
        llm.generate([[5, 6, 7], prompt], params, use_tqdm=False)
    # Nothing was scheduled; the engine still works.
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(n=0), "n must"),
        (dict(detokenize=0), "detokenize"),
        (dict(stop="x", detokenize=False), "stop strings need detokenize"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompt_longer_than_pool_is_refused(llama_dir):
    llm = LLM(model=llama_dir, num_kv_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV pool"):
        llm.generate([[5] * 40], SamplingParams(max_tokens=4), use_tqdm=False)
    # Prompt + max_tokens with EOS ignored can never fit: refused up front, naming the pool.
    with pytest.raises(ValueError, match="16 tokens"):
        llm.generate([[5] * 10], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
    # Without max_tokens a request that fits at first but outgrows the pool ends with "length", not a hang.
    out = llm.generate([[5] * 10], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 16 - 10
    assert_no_leaks(llm)


_LLM_CACHE: dict[str, LLM] = {}


def _shared_llm(model_dir: str) -> LLM:
    if model_dir not in _LLM_CACHE:
        _LLM_CACHE[model_dir] = LLM(model=model_dir, num_kv_blocks=128, block_size=8)
    return _LLM_CACHE[model_dir]


def test_outputs_identical_across_allocation_and_batching_policies(llama_dir):
    """The paper's baselines change memory and timing only, never the tokens."""
    prompts = _prompts(384)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = None
    for kv_allocation in ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"):
        for batching in ("iteration", "request"):
            llm = LLM(model=llama_dir, num_kv_blocks=64, block_size=4, kv_allocation=kv_allocation,
                      batching=batching, max_model_len=128, track_kv_waste=True)
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            if expected is None:
                expected = got
            assert got == expected, (kv_allocation, batching)
            waste = llm.llm_engine.get_stats()["kv_waste"]
            assert waste is not None
            assert_no_leaks(llm)
