"""The simulator: shapes, hardware, cost model (and its fit), traces, the serving loop, the CLI."""

from __future__ import annotations

import argparse
import json
import random
import statistics

import pytest

from pagedllm.config import CacheConfig
from pagedllm.simulator import (
    POLICIES,
    CostModel,
    SimConfig,
    StepFeatures,
    get_hardware,
    get_model_shape,
    kv_pool_blocks,
    load_sharegpt,
    shape_from_hf_config,
    simulate,
    sustained_rate,
    synthetic_trace,
)


def test_opt13b_shape_and_pool_match_the_paper() -> None:
    shape = get_model_shape("opt-13b")
    assert shape.kv_bytes_per_token == 800 * 1024  # "800 KB per token"
    assert 12.5e9 < shape.num_params < 13.2e9
    blocks = kv_pool_blocks(shape, get_hardware("a100-40gb"), 16, 2560)
    assert 800 < blocks < 1100  # ~12 GiB of KV on a 40 GB A100, as in Figure 1
    assert get_model_shape("llama-13b").gated_mlp
    with pytest.raises(ValueError, match="unknown model"):
        get_model_shape("gpt-9")
    with pytest.raises(ValueError, match="unknown hardware"):
        get_hardware("tpu")


def test_shape_from_hf_config(tmp_path) -> None:
    config = {"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
              "num_hidden_layers": 30, "intermediate_size": 1536, "vocab_size": 49152,
              "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = get_model_shape(str(tmp_path))
    assert shape.head_dim == 64 and shape.num_kv_heads == 3 and shape.gated_mlp
    assert shape.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert shape_from_hf_config({"n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 100}).num_layers == 2


def test_traces_match_the_paper_means_and_are_seeded() -> None:
    for kind, (prompt_mean, output_mean) in {"sharegpt": (161.3, 338.0), "alpaca": (19.3, 58.5)}.items():
        trace = synthetic_trace(kind, 4000, rate=2.0, seed=0)
        assert statistics.fmean(r.prompt_len for r in trace) == pytest.approx(prompt_mean, rel=0.06)
        assert statistics.fmean(r.output_len for r in trace) == pytest.approx(output_mean, rel=0.06)
        assert all(r.prompt_len + r.output_len <= 2048 for r in trace)
        # Poisson: mean inter-arrival 1 / rate.
        gaps = [b.arrival_time - a.arrival_time for a, b in zip(trace, trace[1:])]
        assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.1)
    assert synthetic_trace("sharegpt", 20, 1.0, seed=3) == synthetic_trace("sharegpt", 20, 1.0, seed=3)
    assert synthetic_trace("sharegpt", 20, 1.0, seed=3) != synthetic_trace("sharegpt", 20, 1.0, seed=4)


def test_sharegpt_loader_filters_like_vllm(tmp_path) -> None:
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "x" * 40}, {"from": "gpt", "value": "y" * 80}]},
        {"id": "short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "y" * 80}]},
        {"id": "one-turn", "conversations": [{"from": "human", "value": "x" * 40}]},
        {"id": "long", "conversations": [{"from": "human", "value": "x" * 5000}, {"from": "gpt", "value": "y" * 80}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    trace = load_sharegpt(str(path), num_requests=3, rate=1.0)
    assert [(r.prompt_len, r.output_len) for r in trace] == [(10, 20)] * 3  # ~4 chars per token
    trace = load_sharegpt(str(path), num_requests=1, rate=1.0, count_tokens=lambda s: len(s))
    assert (trace[0].prompt_len, trace[0].output_len) == (40, 80)


def test_cost_model_fit_recovers_known_coefficients() -> None:
    truth = CostModel(0.01, 2e-4, 5e-4, 1e-6, 1e-8)
    rng = random.Random(0)
    samples = []
    for _ in range(60):
        if rng.random() < 0.3:
            n = rng.randint(1, 500)
            f = StepFeatures(prefill_tokens=n, prefill_attn_pairs=n * (n + 1) // 2)
        else:
            seqs = rng.randint(1, 64)
            f = StepFeatures(decode_seqs=seqs, kv_tokens_read=seqs * rng.randint(10, 1000))
        samples.append((f, truth.step_time(f) * rng.uniform(0.98, 1.02)))
    fitted = CostModel.fit(samples)
    assert max(fitted.relative_errors(samples)) < 0.05
    assert fitted.fixed_s == pytest.approx(0.01, rel=0.1)
    assert all(c >= 0 for c in (fitted.per_prefill_token_s, fitted.per_decode_seq_s, fitted.per_kv_token_read_s))


def test_roofline_is_memory_bound_for_small_decode_and_compute_bound_for_prefill() -> None:
    model = CostModel.from_hardware(get_model_shape("opt-13b"), get_hardware("a100-40gb"))
    one = model.step_time(StepFeatures(decode_seqs=1, kv_tokens_read=500))
    eight = model.step_time(StepFeatures(decode_seqs=8, kv_tokens_read=4000))
    assert eight < 1.2 * one  # batching decode is nearly free: the weights dominate
    prefill = model.step_time(StepFeatures(prefill_tokens=2048, prefill_attn_pairs=2048 * 2049 // 2))
    assert prefill > 5 * one


def _small_config(policy: str, blocks: int = 120) -> SimConfig:
    return SimConfig(policy=policy, block_size=16, num_gpu_blocks=blocks, max_num_batched_tokens=2560)


def test_simulation_serves_every_request_under_every_policy() -> None:
    cost = CostModel.from_hardware(get_model_shape("opt-13b"), get_hardware("a100-40gb"))
    trace = synthetic_trace("alpaca", 40, rate=0.0, seed=1)  # all at once: memory decides the batch
    results = {policy: simulate(trace, cost, _small_config(policy)) for policy in POLICIES}
    for result in results.values():
        assert result.num_requests == 40 and result.simulated
        assert result.normalized_latency_s > 0
        assert sum(result.kv_waste["fraction_of_pool"].values()) == pytest.approx(1.0)
    assert results["paged"].kv_waste["fraction_of_used"]["token"] > 0.85
    assert results["orca-max"].kv_waste["fraction_of_used"]["token"] < 0.3
    # Paging batches more and serves faster than the reservation baselines when memory binds.
    assert results["paged"].avg_batched_requests > results["orca-oracle"].avg_batched_requests
    assert results["paged"].normalized_latency_s < results["orca-oracle"].normalized_latency_s
    assert results["orca-oracle"].normalized_latency_s < results["orca-max"].normalized_latency_s


def test_simulation_with_parallel_sampling_and_swapping() -> None:
    cost = CostModel.from_hardware(get_model_shape("opt-13b"), get_hardware("a100-40gb"))
    trace = synthetic_trace("alpaca", 20, rate=50.0, seed=2, n=3)
    config = SimConfig(policy="paged", num_gpu_blocks=40, num_cpu_blocks=40, preemption_mode="swap")
    result = simulate(trace, cost, config)
    assert result.num_requests == 20
    assert result.stats["blocks_saved_by_sharing"] == 0  # all freed at the end
    # 3 contiguous runs of a long request need more aligned chunks than 40 blocks hold: refused.
    contiguous = simulate(trace, cost, SimConfig(policy="orca-oracle", num_gpu_blocks=40))
    assert contiguous.num_requests + contiguous.num_ignored == 20 and contiguous.num_requests > 10


def test_sustained_rate() -> None:
    assert sustained_rate([1, 2, 3, 4], [0.1, 0.2, 5.0, 0.1], threshold_s=1.0) == 2
    assert sustained_rate([1, 2], [2.0, 3.0], threshold_s=1.0) == 0.0


def test_simulate_cli(tmp_path, capsys) -> None:
    from pagedllm.entrypoints.simulate_cli import add_simulate_parser

    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "sim.json"
    args = parser.parse_args(["simulate", "--trace", "alpaca", "--rate", "5", "--num-requests", "20",
                              "--policy", "paged", "orca-max", "--num-gpu-blocks", "100", "--json", str(out)])
    assert args.func(args) == 0
    rows = json.loads(out.read_text())
    assert [row["policy"] for row in rows] == ["paged", "orca-max"] and all(row["simulated"] for row in rows)
    assert "SIMULATED" in capsys.readouterr().out


# ------------------------------------------------------------------------------ KV cache dtype


def test_kv_cache_dtype_sets_bytes_per_token_as_the_engine_stores_them() -> None:
    opt = get_model_shape("opt-13b")  # 40 layers x 40 KV heads, head_dim 128, fp16
    per_row = {"auto": 256, "int8": 128 + 2, "fp8": 128 + 2, "fp8_e5m2": 128 + 2, "int4": 64 + 4 * 4}
    for name, row in per_row.items():
        shape = get_model_shape("opt-13b", name)
        assert shape.kv_row_bytes == row
        assert shape.kv_bytes_per_token == 2 * 40 * 40 * row
    assert get_model_shape("opt-13b", "fp8").kv_cache_dtype == "fp8_e4m3"
    assert opt.with_kv_cache_dtype("int8").kv_bytes_per_token == 416000  # 406.25 KiB instead of 800 KiB
    # The default model (30 layers x 3 KV heads, head_dim 64, float32 as the preset says): the
    # simulator reads the same KVCacheFormat the engine's pool is sized by.
    for name, row in {"auto": 64 * 4, "int8": 64 + 2, "int4": 32 + 2 * 4}.items():
        small = get_model_shape("smollm2-135m", name)
        assert small.kv_bytes_per_token == 2 * 30 * 3 * row
        assert small.kv_cache_format is CacheConfig(kv_cache_dtype=name).kv_cache_format
    odd = {"hidden_size": 480, "num_attention_heads": 10, "num_hidden_layers": 2, "vocab_size": 100}  # head_dim 48
    assert shape_from_hf_config(odd, kv_cache_dtype="int8").kv_row_bytes == 50
    with pytest.raises(ValueError, match="multiple of 32"):
        shape_from_hf_config(odd, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        get_model_shape("opt-13b", "int3")


def test_int8_kv_pool_holds_1_97x_the_blocks_of_fp16_in_the_same_memory() -> None:
    hw = get_hardware("a100-40gb")
    fp16, int8 = get_model_shape("opt-13b"), get_model_shape("opt-13b", "int8")
    # The same bytes for KV either way: weights and activations stay fp16.
    free = hw.mem_bytes * 0.9 - fp16.weight_bytes - fp16.activation_bytes(2560)
    assert (int8.weight_bytes, int8.activation_bytes(2560)) == (fp16.weight_bytes, fp16.activation_bytes(2560))
    blocks_fp16 = kv_pool_blocks(fp16, hw, 16, 2560)
    blocks_int8 = kv_pool_blocks(int8, hw, 16, 2560)
    assert blocks_fp16 == int(free // (16 * 819200))  # 961 with today's weight and activation estimates
    assert blocks_int8 == int(free // (16 * 416000))
    assert blocks_int8 / blocks_fp16 == pytest.approx(256 / 130, rel=2e-3)  # 1.97x, less one floor


def test_int8_kv_halves_the_decode_kv_read_time() -> None:
    hw = get_hardware("a100-40gb")
    fp16 = CostModel.from_hardware(get_model_shape("opt-13b"), hw)
    int8 = CostModel.from_hardware(get_model_shape("opt-13b"), hw, kv_cache_dtype="int8")
    assert int8.per_kv_token_read_s == pytest.approx(fp16.per_kv_token_read_s * 130 / 256, rel=1e-12)
    assert int8.per_kv_token_read_s == pytest.approx(416000 / (hw.mem_bandwidth * 0.8), rel=1e-12)
    assert int8.fixed_s == fp16.fixed_s  # the weights are streamed as before
    assert "kv int8" in int8.source and "kv" not in fp16.source.split("(")[1]
    # A memory-bound decode step of 64 sequences x 1000 tokens of context: only its KV reads shrink.
    empty, step = StepFeatures(decode_seqs=64), StepFeatures(decode_seqs=64, kv_tokens_read=64_000)
    kv_fp16 = fp16.step_time(step) - fp16.step_time(empty)
    kv_int8 = int8.step_time(step) - int8.step_time(empty)
    assert kv_fp16 == pytest.approx(64_000 * 819200 / (hw.mem_bandwidth * 0.8), rel=1e-9)
    assert kv_int8 / kv_fp16 == pytest.approx(130 / 256, rel=1e-9)
    assert int8.per_copy_token_s < fp16.per_copy_token_s and int8.per_swap_token_s < fp16.per_swap_token_s


def test_int8_kv_sustains_sharegpt_where_fp16_saturates() -> None:
    # OPT-13B on an A100-40GB at 3 req/s, ShareGPT-like: the paper's fp16 pool runs out (preemptions,
    # latency climbing), the int8 pool in the same memory holds the batch.
    hw = get_hardware("a100-40gb")
    trace = synthetic_trace("sharegpt", 200, rate=3.0, seed=0)
    results = {}
    for kv in ("auto", "int8"):
        shape = get_model_shape("opt-13b", kv)
        config = SimConfig(num_gpu_blocks=kv_pool_blocks(shape, hw, 16, 2560), track_kv_waste=False)
        results[kv] = simulate(trace, CostModel.from_hardware(shape, hw), config)
    fp16, int8 = results["auto"], results["int8"]
    assert fp16.num_requests == int8.num_requests == 200
    assert fp16.num_preempted > 0 and int8.num_preempted < fp16.num_preempted
    assert int8.normalized_latency_s < 0.8 * fp16.normalized_latency_s
    assert int8.throughput_req_s > fp16.throughput_req_s
    slo = 0.04  # s/token, between the two
    assert sustained_rate([3.0], [fp16.normalized_latency_s], slo) == 0.0
    assert sustained_rate([3.0], [int8.normalized_latency_s], slo) == 3.0


def test_simulate_cli_kv_cache_dtype(tmp_path, capsys) -> None:
    from pagedllm.entrypoints.simulate_cli import add_simulate_parser

    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "sim.json"
    args = parser.parse_args(["simulate", "--trace", "alpaca", "--rate", "5", "--num-requests", "10",
                              "--kv-cache-dtype", "int8", "--json", str(out)])
    assert args.func(args) == 0
    [row] = json.loads(out.read_text())
    assert (row["kv_cache_dtype"], row["kv_bytes_per_token"]) == ("int8", 416000)
    assert row["num_gpu_blocks"] == kv_pool_blocks(get_model_shape("opt-13b", "int8"), get_hardware("a100-40gb"),
                                                   16, 2560)
    printed = capsys.readouterr().out
    assert "KV int8 (406.25 KiB/token)" in printed and f"{row['num_gpu_blocks']} KV blocks" in printed
    with pytest.raises(SystemExit):
        parser.parse_args(["simulate", "--kv-cache-dtype", "int3"])
