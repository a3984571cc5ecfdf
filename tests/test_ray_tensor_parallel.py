"""Tensor parallelism placed by Ray: a replica's ranks are Ray actors in the bundles of its placement group.

A local Ray cluster of two simulated nodes of one CPU each (ray.cluster_utils.Cluster): a replica
with tensor_parallel_size 2 and STRICT_SPREAD runs rank 0 on one node and rank 1 on the other, and
answers exactly as one unsplit engine does; a group that cannot be placed is refused with what it
asked for; a killed rank takes its replica down, Ray restarts the replica with new ranks, and it
serves again. An engine outside any group (LLM(..., distributed_executor_backend="ray")) places its
own ranks and frees its group when it shuts down.
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from test_ray_replicas import _wait_for_live_replicas
from test_server import ServerThread

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.serving.data_parallel import DataParallelConfig

MODEL = "tiny"
PROMPTS = ["The quick brown fox", "A block table maps", "Hello, world!", "def main():"]

# A rank that cannot be placed, or a lost collective, fails in seconds instead of two minutes.
os.environ.setdefault("PAGEDLLM_TP_TIMEOUT", "30")


def _engine_args(model_dir: str, **overrides) -> EngineArgs:
    kwargs = dict(model=model_dir, num_kv_blocks=64, block_size=16, device="cpu", dtype="float32", max_num_seqs=8,
                  num_threads=1)
    kwargs.update(overrides)
    return EngineArgs(**kwargs)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def expected(model_dir) -> list[str]:
    """The unsplit engine's greedy completions of PROMPTS."""
    app = build_app(_engine_args(model_dir), served_model_name=MODEL)
    with ServerThread(app) as running, httpx.Client(base_url=running.url, timeout=60) as http:
        return [_complete(http, prompt) for prompt in PROMPTS]


def _complete(http: httpx.Client, prompt: str, max_tokens: int = 12) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_tp2_spread_over_two_nodes_answers_as_one_engine(ray_cluster, model_dir, expected):
    import ray

    config = DataParallelConfig(data_parallel_size=1, distributed_executor_backend="ray",
                                health_interval_s=0.25, health_timeout_s=5.0)
    args = _engine_args(model_dir, tensor_parallel_size=2, placement_group_strategy="STRICT_SPREAD")
    app = build_app(args, served_model_name=MODEL, data_parallel=config)
    with ServerThread(app) as running, httpx.Client(base_url=running.url, timeout=60) as http:
        replicated = running.app.state.async_engine
        placement = ray.get(replicated.actors[0].describe.remote())["tensor_parallel_placement"]
        # STRICT_SPREAD over two one-CPU nodes: rank 0 (the replica) on one node, rank 1 on the other.
        assert sorted(placement) == [0, 1]
        assert placement[0]["node_id"] != placement[1]["node_id"]
        assert [_complete(http, prompt) for prompt in PROMPTS] == expected

        # A rank killed under the replica: the replica's engine fails, Ray restarts the replica with
        # new ranks in the same placement group, and it answers the same again.
        os.kill(placement[1]["pid"], signal.SIGKILL)
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        response = http.post("/v1/completions", json=body)
        assert response.status_code in (200, 500, 503), response.text
        if response.status_code != 200:
            assert response.json()["error"]["message"]
        _wait_for_live_replicas(http, 1, timeout=90.0)
        assert _complete(http, PROMPTS[1]) == expected[1]
        moved = ray.get(replicated.actors[0].describe.remote())["tensor_parallel_placement"]
        assert moved[1]["pid"] != placement[1]["pid"]
    # The server's shutdown frees the replica's placement group.
    groups = ray.util.placement_group_table()
    assert all(group["state"] == "REMOVED" for group in groups.values())


def test_a_group_that_cannot_be_placed_is_refused_with_what_it_asked(ray_cluster, model_dir, monkeypatch):
    from pagedllm.serving.replica_frontend import ReplicatedEngine

    monkeypatch.setenv("PAGEDLLM_TP_TIMEOUT", "3")
    config = DataParallelConfig(data_parallel_size=1, distributed_executor_backend="ray")
    # STRICT_PACK wants both ranks' CPUs on one node; every node here has one.
    args = _engine_args(model_dir, tensor_parallel_size=2, placement_group_strategy="STRICT_PACK")
    with pytest.raises(ValueError, match=r"could not place replica 0's 2 tensor-parallel ranks .* STRICT_PACK"):
        ReplicatedEngine.from_engine_args(args, config)


def test_an_engine_outside_any_group_places_its_own_ranks(ray_cluster, model_dir, expected):
    import ray

    llm = LLM(**vars_of(_engine_args(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray")))
    try:
        ranks = llm.llm_engine.worker.ranks
        assert set(ranks.placement()) == {0, 1}
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        texts = [output.outputs[0].text for output in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert texts == expected
    finally:
        llm.llm_engine.shutdown()
    groups = ray.util.placement_group_table()
    assert all(group["state"] == "REMOVED" for group in groups.values())


def vars_of(args: EngineArgs) -> dict:
    return {name: getattr(args, name) for name in args.__dataclass_fields__}
