"""What the engine reports about its KV pool: the KV dtype, bytes per token and block counts.

The start-up log, get_stats(), /metrics (cache_config_info and the byte gauges) and the
dashboard's /dashboard/state all name the format and size the pool was built with. The tiny
Llama of conftest.py: 2 layers, 2 KV heads of 16 dims, float32 weights.
"""

from __future__ import annotations

import logging
import re

import httpx
import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.engine.kv_pool_info import format_bytes, kv_dtype_label
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.metrics import ServerMetrics

BLOCK_SIZE = 16
KV_CACHE_MEMORY = 1 << 20


def tiny_engine(model_path: str, kv_cache_dtype: str, **overrides) -> LLMEngine:
    settings = dict(model=model_path, kv_cache_memory=KV_CACHE_MEMORY, block_size=BLOCK_SIZE, device="cpu",
                    dtype="float32", max_num_seqs=4, num_threads=1, kv_cache_dtype=kv_cache_dtype)
    settings.update(overrides)
    return LLMEngine.from_engine_args(EngineArgs(**settings))


def expected_bytes_per_token(engine: LLMEngine, kv_cache_dtype: str) -> int:
    hf = engine.model_config.hf_config
    layers, kv_heads = hf.num_hidden_layers, hf.num_key_value_heads
    head_dim = hf.hidden_size // hf.num_attention_heads
    if kv_cache_dtype == "auto":
        return 2 * layers * kv_heads * head_dim * torch.float32.itemsize
    return 2 * layers * kv_heads * (head_dim + 2)  # one byte a value, a float16 scale per row


@pytest.fixture(scope="module")
def llama_path(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


def test_stats_name_the_format_and_int8_holds_more_blocks(llama_path, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm.engine.llm_engine"):
        auto = tiny_engine(llama_path, "auto")
        int8 = tiny_engine(llama_path, "int8")
    auto_stats, int8_stats = auto.get_stats(), int8.get_stats()

    assert auto_stats["kv_cache_dtype"] == "auto" and auto_stats["kv_cache_storage"] == "float32"
    assert int8_stats["kv_cache_dtype"] == "int8" and int8_stats["kv_cache_storage"] == "int8"
    auto_bpt, int8_bpt = expected_bytes_per_token(auto, "auto"), expected_bytes_per_token(int8, "int8")
    assert (auto_bpt, int8_bpt) == (512, 144)
    assert auto_stats["kv_bytes_per_token"] == auto_bpt and int8_stats["kv_bytes_per_token"] == int8_bpt
    for engine, stats, per_token in ((auto, auto_stats, auto_bpt), (int8, int8_stats, int8_bpt)):
        assert stats["num_gpu_blocks"] == engine.num_gpu_blocks == KV_CACHE_MEMORY // (BLOCK_SIZE * per_token)
        assert stats["kv_block_bytes"] == BLOCK_SIZE * per_token
        assert stats["kv_gpu_pool_bytes"] == engine.num_gpu_blocks * BLOCK_SIZE * per_token <= KV_CACHE_MEMORY
        # The pool the cache engine allocated is the size reported.
        pool = engine.worker.cache_engine.gpu_pool
        assert pool.numel() * pool.element_size() == stats["kv_gpu_pool_bytes"]
    # The same memory holds float32 bytes / int8 bytes (3.6x) as many blocks, up to rounding.
    ratio = auto_bpt / int8_bpt
    assert abs(int8.num_gpu_blocks - ratio * auto.num_gpu_blocks) < ratio + 1

    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool:")]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"KV pool: auto (float32), {auto_bpt} bytes/token"), lines[0]
    assert lines[1].startswith(f"KV pool: int8, {int8_bpt} bytes/token"), lines[1]
    assert f"{int8.num_gpu_blocks} device blocks, 0 CPU blocks of {BLOCK_SIZE} tokens" in lines[1]
    assert f"device pool {format_bytes(int8_stats['kv_gpu_pool_bytes'])}" in lines[1]


def test_fp8_is_reported_by_its_canonical_name_and_swap_blocks_counted(llama_path):
    engine = tiny_engine(llama_path, "fp8", swap_space=1 << 16)
    stats = engine.get_stats()
    assert stats["kv_cache_dtype"] == "fp8_e4m3" and kv_dtype_label(stats) == "fp8_e4m3"
    assert stats["kv_bytes_per_token"] == expected_bytes_per_token(engine, "fp8_e4m3")
    assert stats["num_cpu_blocks"] == engine.num_cpu_blocks == (1 << 16) // stats["kv_block_bytes"]
    assert stats["kv_cpu_pool_bytes"] == engine.num_cpu_blocks * stats["kv_block_bytes"]


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 1023, 1536, 3 << 20, 5 << 30, 5 << 40)] == \
        ["0 B", "1023 B", "1.5 KiB", "3.0 MiB", "5.0 GiB", "5120.0 GiB"]


def scraped(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of ``pagedllm:<name>`` in a Prometheus text exposition: (labels, value)."""
    samples = []
    for labels, value in re.findall(rf"^pagedllm:{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        samples.append((dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
    return samples


def test_metrics_render_the_engine_stats(llama_path):
    engine = tiny_engine(llama_path, "int8")
    metrics = ServerMetrics("tiny")
    metrics.update_stats(engine.get_stats())
    text = metrics.render().decode()
    [(labels, value)] = scraped(text, "cache_config_info")
    assert value == 1.0
    assert labels == {"model_name": "tiny", "block_size": str(BLOCK_SIZE), "cache_dtype": "int8",
                      "cache_storage_dtype": "int8", "num_gpu_blocks": str(engine.num_gpu_blocks),
                      "num_cpu_blocks": "0", "kv_bytes_per_token": "144"}
    assert scraped(text, "kv_cache_bytes_per_token") == [({"model_name": "tiny"}, 144.0)]
    assert scraped(text, "num_gpu_blocks") == [({"model_name": "tiny"}, float(engine.num_gpu_blocks))]
    assert scraped(text, "num_cpu_blocks") == [({"model_name": "tiny"}, 0.0)]
    assert scraped(text, "kv_cache_block_bytes") == [({"model_name": "tiny"}, 144.0 * BLOCK_SIZE)]
    pool_bytes = 144.0 * BLOCK_SIZE * engine.num_gpu_blocks
    assert scraped(text, "kv_cache_pool_bytes") == [({"model_name": "tiny"}, pool_bytes)]


def test_metrics_without_pool_stats_leave_the_info_out():
    # An engine that does not say what its pool stores gets no cache_config_info (no label would be true).
    metrics = ServerMetrics("tiny")
    metrics.update_stats({"num_running": 0, "num_gpu_blocks": 8})
    text = metrics.render().decode()
    assert "cache_config_info" not in text and "kv_cache_bytes_per_token" not in text
    assert scraped(text, "num_gpu_blocks") == [({"model_name": "tiny"}, 8.0)]


def test_server_metrics_and_dashboard_state_of_an_int8_engine(llama_path):
    from test_server import ServerThread

    from pagedllm.entrypoints.openai.api_server import build_app

    engine = tiny_engine(llama_path, "int8")
    num_blocks = engine.num_gpu_blocks
    app = build_app(engine=engine, served_model_name="tiny", log_requests=False)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        done = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4,
                                                   "temperature": 0.0, "ignore_eos": True})
        assert done.status_code == 200, done.text
        text = client.get("/metrics").text
        state = client.get("/dashboard/state").json()
        page = client.get("/dashboard").text
    [(labels, value)] = scraped(text, "cache_config_info")
    assert value == 1.0 and labels["cache_dtype"] == "int8" and labels["num_gpu_blocks"] == str(num_blocks)
    assert scraped(text, "kv_cache_bytes_per_token")[0][1] == 144.0
    assert scraped(text, "num_gpu_blocks")[0][1] == float(num_blocks)

    kv = state["kv_cache"]
    assert kv["dtype"] == "int8" and kv["storage"] == "int8" and kv["bytes_per_token"] == 144
    assert kv["block_bytes"] == 144 * BLOCK_SIZE and kv["pool_bytes"] == 144 * BLOCK_SIZE * num_blocks
    assert kv["cpu_pool_bytes"] == 0
    assert state["blocks"]["total"] == num_blocks and state["blocks"]["cpu_total"] == 0
    assert 'id="kv-dtype"' in page and 'id="kv-bytes-per-token"' in page and 'id="kv-gpu-blocks"' in page
