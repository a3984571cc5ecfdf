"""The engine's greedy output equals transformers' at every instruction-set level this CPU runs: the
whole step (GEMMs, norms, rotary, attention, greedy choice) through that level's kernels."""

from __future__ import annotations

import functools

import pytest
from conftest import assert_no_leaks
from oracle import hf_greedy
from test_engine import NUM_NEW_TOKENS, _prompts

from pagedllm import LLM, SamplingParams


@functools.cache
def _reference(model_dir: str, vocab: int) -> list[list[int]]:
    return hf_greedy(model_dir, _prompts(vocab), NUM_NEW_TOKENS)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_equals_transformers_at_every_level(tiny_model_factory, kind, kernel_level):
    model_dir = tiny_model_factory(kind)
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=128, block_size=8)
    vocab = llm.llm_engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(_prompts(vocab), params, use_tqdm=False)]
    expected = _reference(model_dir, vocab)  # hf_greedy checked it is not degenerate
    assert ours == expected
    assert_no_leaks(llm)
    kernel_level.assert_ran("paged_decode_attention", "fused_ops", "greedy_pick")
    if kernel_level.has("dense_gemm_f32"):
        kernel_level.assert_ran("dense_gemm_f32")
