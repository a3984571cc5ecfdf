"""Tensor parallelism on CPU (gloo, 2 ranks): same greedy output as one process and as transformers,
with sharing features and preemption; shards are 1/world of the full weights; a killed worker gives
an error naming its rank and leaves no process behind.

Starting a rank costs seconds (a fresh interpreter imports torch), so one tensor-parallel Llama
engine serves most tests of this module and the worker-death test, which breaks it, runs last.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import signal
import time

import pytest
import torch
from conftest import assert_no_leaks
from oracle import hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import use_kernel_config
from pagedllm.layers.parallel_state import get_tp_world_size, override_tp_state
from pagedllm.models.loader import build_model, load_model_config

# A lost collective fails the test in seconds instead of the default two minutes.
os.environ.setdefault("PAGEDLLM_TP_TIMEOUT", "30")

NUM_NEW_TOKENS = 24
# Tight on purpose: 8 long sequences cannot all hold their KV at once, so the engines preempt.
TIGHT_BLOCKS = 40
BLOCK_SIZE = 4


def _prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab_size) for _ in range(n)] for n in (1, 3, 7, 16, 17, 30, 45, 64)]


def _engine_kwargs(**overrides) -> dict:
    kwargs = dict(dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_kv_blocks=TIGHT_BLOCKS)
    kwargs.update(overrides)
    return kwargs


def _greedy(llm: LLM, prompts, max_tokens: int = NUM_NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _children_alive() -> list[multiprocessing.process.BaseProcess]:
    return [proc for proc in multiprocessing.active_children() if proc.name.startswith("pagedllm-tp")]


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def tp_llama(llama_dir):
    """One 2-rank engine for the module; swap preemption, so swapping runs on both ranks too, and a
    16-token step budget, so prompts go to the ranks in chunks mixed with decodes."""
    llm = LLM(llama_dir, tensor_parallel_size=2, preemption_mode="swap", swap_space="1MiB", max_num_batched_tokens=16,
              **_engine_kwargs())
    yield llm
    llm.llm_engine.shutdown()
    assert not _children_alive()


@pytest.fixture(scope="module")
def tp1_llama(llama_dir):
    return LLM(llama_dir, preemption_mode="swap", swap_space="1MiB", max_num_batched_tokens=16, **_engine_kwargs())


# ---------------------------------------------------------------------- sharding, in one process


def _shards(model_dir: str, world_size: int) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    # Plain parameters to compare: the oneDNN path would keep only reordered copies.
    with use_kernel_config(gemm="torch"):
        return _build_shards(model_dir, world_size)


def _build_shards(model_dir: str, world_size: int) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    model_config = load_model_config(model_dir, "float32")
    full = build_model(model_config)
    shards = []
    for rank in range(world_size):
        with override_tp_state(rank, world_size):
            shards.append(build_model(model_config))
    assert get_tp_world_size() == 1
    return full, shards


# Parameters split across ranks, and along which dim; all others are replicated whole.
_SPLIT = {
    "llama": {"qkv_proj.weight": 0, "o_proj.weight": 1, "gate_up_proj.weight": 0, "down_proj.weight": 1,
              "embed_tokens.weight": 0, "lm_head.weight": 0},
    "gpt2": {"qkv_proj.weight": 0, "qkv_proj.bias": 0, "out_proj.weight": 1, "c_fc.weight": 0, "c_fc.bias": 0,
             "mlp.c_proj.weight": 1, "wte.weight": 0},
    "opt": {"qkv_proj.weight": 0, "qkv_proj.bias": 0, "out_proj.weight": 1, "fc1.weight": 0, "fc1.bias": 0,
            "fc2.weight": 1, "embed_tokens.weight": 0},
}


@pytest.mark.parametrize("kind", ["llama", "gpt2", "opt"])
def test_each_rank_holds_half_of_every_split_weight(tiny_model_factory, kind):
    full, shards = _shards(tiny_model_factory(kind), 2)
    full_params = dict(full.named_parameters())
    num_split = 0
    for shard in shards:
        for name, param in shard.named_parameters():
            whole = full_params[name]
            dims = [dim for key, dim in _SPLIT[kind].items() if name.endswith(key)]
            expected = list(whole.shape)
            if dims:
                expected[dims[0]] = -(-expected[dims[0]] // 2)  # the vocabulary is padded to a multiple
                num_split += 1
            else:
                torch.testing.assert_close(param, whole, rtol=0, atol=0)
            assert list(param.shape) == expected, name
    assert num_split >= 2 * len(_SPLIT[kind]) - 2
    # Column-parallel shards stacked back give the full matrix (the MLP's up projection here).
    if kind == "llama":
        inter = full.config.intermediate_size
        up = torch.cat([s.model.layers[0].mlp.gate_up_proj.weight[inter // 2 :] for s in shards])
        torch.testing.assert_close(up, full.model.layers[0].mlp.gate_up_proj.weight[inter:], rtol=0, atol=0)


def test_kv_heads_replicated_when_fewer_than_ranks(llama_dir):
    """4 query heads, 2 KV heads, 4 ranks: each rank keeps one query head and the KV head it reads."""
    full, shards = _shards(llama_dir, 4)
    head_dim = full.model.layers[0].self_attn.head_dim
    q_size = 4 * head_dim
    full_qkv = full.model.layers[0].self_attn.qkv_proj.weight
    for rank, shard in enumerate(shards):
        attn = shard.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
        kv_head = rank // 2
        k_rows = full_qkv[q_size + kv_head * head_dim : q_size + (kv_head + 1) * head_dim]
        torch.testing.assert_close(attn.qkv_proj.weight[head_dim : 2 * head_dim], k_rows, rtol=0, atol=0)


def test_indivisible_heads_are_refused(llama_dir):
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size"):
        LLM(llama_dir, tensor_parallel_size=3, **_engine_kwargs())
    assert not _children_alive()


def test_control_message_sends_block_table_changes_only():
    from pagedllm.executor.messages import StepDecoder, StepEncoder
    from pagedllm.sampling import SamplingRow
    from pagedllm.worker.model_runner import SeqStepInput, StepInput

    row = SamplingRow(SamplingParams(), [1, 2, 3], [], None)

    def step(tables: dict[int, list[int]]) -> StepInput:
        return StepInput([SeqStepInput(i, [7], 5, t, row if i else None) for i, t in tables.items()],
                         blocks_to_copy=[(1, 2)])

    encoder, decoder = StepEncoder(), StepDecoder()
    long_table = list(range(100, 612))
    sequence = [
        {0: [1, 2], 1: long_table},
        {0: [1, 2], 1: long_table},  # nothing changed
        {0: [1, 2, 3], 1: long_table + [9]},  # a block appended
        {0: [1, 4, 3], 1: long_table[:-1] + [8, 9]},  # a middle block replaced / the last replaced + appended
        {1: long_table},  # 0 left the batch
        {0: [5], 1: long_table},  # and came back (whole table again)
    ]
    sizes = []
    for tables in sequence:
        data = encoder.encode(step(tables))
        sizes.append(len(data))
        got = decoder.decode(data)
        assert [s.block_table for s in got.seqs] == list(tables.values())
        assert [s.sampling_row is not None for s in got.seqs] == [i != 0 for i in tables]
        assert got.blocks_to_copy == [(1, 2)] and got.seqs[0].token_ids == [7] and got.seqs[0].start_pos == 5
    assert sizes[1] < 100 < 1000 < sizes[0]  # a 512-block table is sent once, then not again
    assert decoder.decode(encoder.encode(None)) is None


# ---------------------------------------------------------------------- two ranks, end to end
# (GPT-2 and OPT first: one tensor-parallel engine per process at a time, and tp_llama lives to the end.)


@pytest.mark.parametrize("kind", ["gpt2", "opt"])
def test_gpt2_opt_greedy_equals_one_process_and_transformers(tiny_model_factory, kind):
    model_dir = tiny_model_factory(kind)
    prompts = _prompts(300)
    tp1 = LLM(model_dir, **_engine_kwargs())
    tp2 = LLM(model_dir, tensor_parallel_size=2, **_engine_kwargs())
    try:
        got = _greedy(tp2, prompts)
        assert got == _greedy(tp1, prompts)
        assert got == hf_greedy(model_dir, prompts, NUM_NEW_TOKENS)
        assert tp2.llm_engine.get_stats()["num_preempted"] > 0  # recomputation, this time
        assert_no_leaks(tp2)
    finally:
        tp2.llm_engine.shutdown()
    assert not _children_alive()


def test_llama_greedy_equals_one_process_and_transformers(tp_llama, tp1_llama, llama_dir):
    prompts = _prompts(tp_llama.llm_engine.vocab_size)
    got = _greedy(tp_llama, prompts)
    assert got == _greedy(tp1_llama, prompts)
    assert got == hf_greedy(llama_dir, prompts, NUM_NEW_TOKENS)
    stats = tp_llama.llm_engine.get_stats()
    assert stats["num_preempted"] > 0 and stats["num_blocks_swapped_out"] > 0
    assert stats["tensor_parallel_size"] == 2 and stats["tp_comm_s"] > 0 and stats["tp_num_all_reduce"] > 0
    assert 0 < stats["tp_last_message_bytes"] < 4096
    # Each rank's pool holds its one KV head of the two.
    cache = tp_llama.llm_engine.worker.worker.cache_engine
    assert cache.gpu_pool.shape[4] == 1
    assert_no_leaks(tp_llama)


def test_parallel_sampling_and_prefix_caching(tp_llama, tp1_llama):
    rng = random.Random(1)
    shared = [rng.randrange(4, 300) for _ in range(24)]
    prompts = [shared + [rng.randrange(4, 300) for _ in range(n)] for n in (2, 5)]
    sampled = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)
    results = []
    for llm in (tp_llama, tp1_llama):
        before = llm.llm_engine.get_stats()["prefix_cache_hit_tokens"]
        greedy = _greedy(llm, prompts, 12) + _greedy(llm, prompts, 12)  # the second run hits the prefix cache
        hits = llm.llm_engine.get_stats()["prefix_cache_hit_tokens"] - before
        outs = llm.generate(prompts, sampled, use_tqdm=False)
        results.append((greedy, [[c.token_ids for c in o.outputs] for o in outs]))
        assert hits > 0
        assert_no_leaks(llm)
    assert results[0] == results[1]
    assert len({tuple(ids) for ids in results[0][1][0]}) > 1  # the samples differ


def test_beam_search(tp_llama, tp1_llama):
    params = SamplingParams(use_beam_search=True, n=2, best_of=3, temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = _prompts(300)[2:5]
    got = [[c.token_ids for c in o.outputs] for o in tp_llama.generate(prompts, params, use_tqdm=False)]
    expected = [[c.token_ids for c in o.outputs] for o in tp1_llama.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert_no_leaks(tp_llama)


def test_prompt_logprobs_and_structured_outputs(tp_llama, tp1_llama):
    from pagedllm.sampling_params import StructuredOutputsParams

    prompts = _prompts(300)[:3]
    params = [SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2),
              SamplingParams(max_tokens=6, temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[a-f]+")),
              SamplingParams(max_tokens=6, temperature=0.0)]
    got, expected = (llm.generate(prompts, params, use_tqdm=False) for llm in (tp_llama, tp1_llama))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert got[0].prompt_logprobs[0] is None and len(got[0].prompt_logprobs) == len(got[0].prompt_token_ids)
    for mine, theirs in zip(got[0].prompt_logprobs[1:], expected[0].prompt_logprobs[1:]):
        assert mine.keys() == theirs.keys()
        assert list(mine.values()) == pytest.approx(list(theirs.values()), abs=1e-4)
    assert_no_leaks(tp_llama)


def test_killed_worker_fails_requests_with_its_rank_and_leaves_no_process(tp_llama):
    """Runs last: it breaks the module's engine. The async front must fail the request and go unhealthy."""
    from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError

    engine = tp_llama.llm_engine
    worker_pid = engine.worker.processes[1].pid

    async def scenario() -> tuple[BaseException | None, float, int]:
        front = AsyncLLMEngine(engine)
        params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        outputs = 0
        error: BaseException | None = None
        killed_at = 0.0
        try:
            async for _ in front.generate([5, 6, 7, 8], params, "doomed"):
                outputs += 1
                if outputs == 3:
                    os.kill(worker_pid, signal.SIGKILL)
                    killed_at = time.monotonic()
        except EngineDeadError as exc:
            error = exc
        assert not front.is_healthy
        await front.shutdown()
        return error, time.monotonic() - killed_at, outputs

    error, elapsed, outputs = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert error is not None, f"the request finished ({outputs} outputs) although its worker was killed"
    assert "rank 1" in str(error) and "SIGKILL" in str(error)
    assert elapsed < 20
    assert not _children_alive()
    with pytest.raises(ProcessLookupError):
        os.kill(worker_pid, 0)
