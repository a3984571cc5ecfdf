"""Speculative decoding with a draft model: its KV in the target's pool under the target's block tables.

The model as its own draft must be accepted nearly always (the mechanics: the draft's KV is caught up
with every step's tokens and follows every block move); a different random model with the same
tokenizer is mostly rejected, which exercises every accept pattern. Either way the output is the
plain run's token for token, with preemption (recompute and swap), prefix-cache hits and parallel
samples sharing blocks, and no block leaks.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from conftest import assert_no_leaks
from requirements_here import require
from test_spec_decode import SETTINGS, repeating_prompts, run, spec_stats

from pagedllm import LLM, SamplingParams
from pagedllm.config import SpeculativeConfig
from pagedllm.models.loader import default_model_path


def draft_config(model: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def shared_prefix_prompts() -> list[list[int]]:
    rng = random.Random(1)
    shared = [rng.randrange(10, 380) for _ in range(9)]
    return [shared + [rng.randrange(10, 380) for _ in range(n)] for n in (1, 4, 7, 11, 2, 6)]


def test_the_model_as_its_own_draft_is_accepted(tiny_model_factory) -> None:
    model = tiny_model_factory("llama")
    prompts = repeating_prompts() + shared_prefix_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=1)
    plain = run(LLM(model=model, **SETTINGS), prompts, params)
    llm = LLM(model=model, speculative_config=draft_config(model), **SETTINGS)
    assert run(llm, prompts, params) == plain
    stats = spec_stats(llm)
    assert stats["spec_decode_num_draft_tokens"] > 100, stats
    assert stats["spec_decode_num_accepted_tokens"] >= 0.95 * stats["spec_decode_num_draft_tokens"], stats
    assert_no_leaks(llm)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_a_rejected_draft_keeps_output_and_blocks(tiny_model_factory, preemption_mode) -> None:
    """Another architecture (same tokenizer) as the draft, in a pool small enough to preempt."""
    target, draft = tiny_model_factory("llama"), tiny_model_factory("qwen2")
    prompts = shared_prefix_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    tight = dict(SETTINGS, num_kv_blocks=28, preemption_mode=preemption_mode, swap_space="1MiB")
    plain = run(LLM(model=target, **tight), prompts, params)
    config = dict(draft_config(draft), min_request_drafts=1 << 30)  # keep speculating however bad
    llm = LLM(model=target, speculative_config=config, **tight)
    assert run(llm, prompts, params) == plain
    stats = llm.llm_engine.get_stats()
    assert stats["num_preempted"] > 0  # the pool really was the bottleneck
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]
    assert_no_leaks(llm)


def test_seeded_sampling_is_the_plain_run_and_parallel_samples_repeat(tiny_model_factory) -> None:
    """Seeded n = 1 requests sample the plain run's tokens; n = 2 forks (one generator, every draw
    kept) give the same samples on a rerun, each fork drafting after a copy-on-write of the shared block."""
    model = tiny_model_factory("llama")
    prompts = repeating_prompts()[:3]
    params = [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=3 + i) for i in range(3)]
    config = draft_config(model, k=3)
    plain = run(LLM(model=model, **SETTINGS), prompts, params)
    llm = LLM(model=model, speculative_config=config, **SETTINGS)
    assert run(llm, prompts, params) == plain
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    forks = SamplingParams(n=2, temperature=0.7, max_tokens=16, ignore_eos=True, seed=9)
    first = run(llm, prompts[:2], forks)
    assert run(LLM(model=model, speculative_config=config, **SETTINGS), prompts[:2], forks) == first
    assert llm.llm_engine.scheduler.block_manager.num_cow_copies > 0
    assert_no_leaks(llm)


def test_the_pool_holds_both_models_per_block(tiny_model_factory) -> None:
    """A block id is one position range of both models: at one KV budget, the model drafting for itself
    gets half the blocks."""
    model = tiny_model_factory("llama")
    budget = dict(SETTINGS, num_kv_blocks=None, kv_cache_memory=1 << 20)
    alone = LLM(model=model, **budget).llm_engine.num_gpu_blocks
    with_draft = LLM(model=model, speculative_config=draft_config(model), **budget).llm_engine.num_gpu_blocks
    assert with_draft == alone // 2


def test_draft_model_errors(tiny_model_factory) -> None:
    model = tiny_model_factory("llama")
    assert SpeculativeConfig.parse({"model": model}).method == "draft_model"
    with pytest.raises(ValueError, match="'model' .* is required with method 'draft_model'"):
        SpeculativeConfig.parse({"method": "draft_model"})
    with pytest.raises(ValueError, match="and only with it"):
        SpeculativeConfig.parse({"method": "ngram", "model": model})
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1"):
        SpeculativeConfig.parse({"model": model, "draft_tensor_parallel_size": 2})
    # The embedded default model has another vocabulary than the tiny test models.
    with pytest.raises(ValueError, match="another tokenizer"):
        LLM(model=model, speculative_config=draft_config(default_model_path()), **SETTINGS)


def test_serve_with_a_missing_draft_exits_with_the_message(tiny_model_factory) -> None:
    """The server binds its port before the model loads: a draft that cannot load must still end the
    process, non-zero, with the reason on stderr."""
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", tiny_model_factory("llama"), "--port", "0",
               "--device", "cpu", "--speculative-config", '{"method": "draft_model", "model": "/no/such/draft"}']
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "the draft model path '/no/such/draft' does not exist" in done.stderr
    assert "Traceback" not in done.stderr


def test_replicas_refuse_a_foreign_draft_before_ray_starts(tiny_model_factory) -> None:
    """Data-parallel replicas start engines in Ray actors; a draft that cannot work there is named by
    the front end (a ValueError the server reports) instead of dying inside an actor."""
    ray = require("ray")
    from pagedllm.config import EngineArgs
    from pagedllm.serving.data_parallel import DataParallelConfig
    from pagedllm.serving.replica_launch import start_replicas

    args = EngineArgs(model=tiny_model_factory("llama"), speculative_config=draft_config(default_model_path()),
                      **SETTINGS)
    with pytest.raises(ValueError, match="another tokenizer"):
        start_replicas(args, DataParallelConfig(data_parallel_size=2))
    assert not ray.is_initialized()
