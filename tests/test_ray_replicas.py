"""Data-parallel engine replicas on Ray behind the one OpenAI front end.

A local Ray cluster of two simulated nodes of one CPU each (ray.cluster_utils.Cluster, started
once for the module), a tiny random Llama, two replicas (one per node): requests spread over
both, a shared prefix stays on one replica, greedy output equals the single-engine server's, and
killing a replica's actor under load ends every request with its tokens or an error while Ray
brings the replica back. The flag checks at the end need no Ray.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
from test_server import ServerThread

from pagedllm.config import EngineArgs
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.serving import data_parallel
from pagedllm.serving.data_parallel import DataParallelConfig, DataParallelUnavailableError

MODEL = "tiny"
BLOCK_SIZE = 16


def _engine_args(model_dir: str) -> EngineArgs:
    return EngineArgs(model=model_dir, num_kv_blocks=128, block_size=BLOCK_SIZE, device="cpu", dtype="float32",
                      max_num_seqs=32, num_threads=1)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def server(ray_cluster, model_dir):
    config = DataParallelConfig(data_parallel_size=2, distributed_executor_backend="ray", router="prefix",
                                health_interval_s=0.25, health_timeout_s=3.0)
    app = build_app(_engine_args(model_dir), served_model_name=MODEL, data_parallel=config)
    with ServerThread(app) as running, httpx.Client(base_url=running.url, timeout=60) as http:
        yield running, http


def _metric(http: httpx.Client, name: str, labels: str = "") -> dict[str, float]:
    """Samples of pagedllm:NAME whose labels contain ``labels``, by their replica label."""
    text = http.get("/metrics").text
    found: dict[str, float] = {}
    for label_text, value in re.findall(rf"^pagedllm:{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        if labels in label_text:
            replica = re.search(r'replica="(\d+)"', label_text)
            found[replica.group(1) if replica else ""] = float(value)
    return found


def _complete(http: httpx.Client, prompt: str | list[int], max_tokens: int = 8, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    body.update(extra)
    return http.post("/v1/completions", json=body)


def _stream(http: httpx.Client, prompt: str, max_tokens: int, on_chunk=None) -> dict:
    """One streaming completion: its text, the usage at the end, an error event, whether [DONE] came."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result: dict = {"text": "", "chunks": 0, "usage": None, "error": None, "done": False, "status": None}
    with http.stream("POST", "/v1/completions", json=body) as response:
        result["status"] = response.status_code
        if response.status_code != 200:
            result["error"] = json.loads(response.read())["error"]
            return result
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                result["done"] = True
                continue
            event = json.loads(data)
            if "error" in event:
                result["error"] = event["error"]
            elif event["choices"]:
                result["text"] += event["choices"][0]["text"]
                result["chunks"] += 1
                if on_chunk is not None:
                    on_chunk()
            elif event.get("usage"):
                result["usage"] = event["usage"]
    return result


def test_health_counts_live_replicas(server):
    _, http = server
    response = http.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "live_replicas": 2, "replicas": 2}


def test_dashboard_views_every_replica_and_each(server):
    _, http = server
    assert http.get("/dashboard/replicas").json() == {
        "views": ["all", "0", "1"], "default": "all",
        "replicas": [{"replica": 0, "live": True}, {"replica": 1, "live": True}]}
    for replica in (0, 1):  # each snapshot taken in that replica's actor
        state = http.get("/dashboard/state", params={"replica": str(replica)}).json()
        assert (state["view"], state["replica"]) == (str(replica), replica)
        assert state["blocks"]["total"] == 128 and state["kv_cache"]["dtype"] and "counters" in state
    merged = http.get("/dashboard/state").json()  # the default: both pools side by side
    assert merged["view"] == "all" and [s["replica"] for s in merged["segments"]] == [0, 1]
    assert merged["blocks"]["total"] == 256 and len(merged["map"]["state"]) == 256
    assert merged["kv_cache"]["pool_bytes"] == 2 * state["kv_cache"]["pool_bytes"]
    response = http.get("/dashboard/state", params={"replica": "2"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "replica"


def test_greedy_output_equals_single_engine_server(server, model_dir):
    _, http = server
    prompts = ["The quick brown fox", "A block table maps", "Hello, world!", "def main():"]
    replicated = [_complete(http, p, max_tokens=12).json()["choices"][0]["text"] for p in prompts]
    streamed = _stream(http, prompts[0], max_tokens=12)
    # Tokens arrive as they come: several chunks, the same text.
    assert streamed["done"] and streamed["error"] is None and streamed["chunks"] > 1
    assert streamed["text"] == replicated[0]
    single = build_app(_engine_args(model_dir), served_model_name=MODEL)
    with ServerThread(single) as running, httpx.Client(base_url=running.url, timeout=60) as single_http:
        expected = [_complete(single_http, p, max_tokens=12).json()["choices"][0]["text"] for p in prompts]
    assert all(replicated) and replicated == expected


def test_requests_spread_over_both_replicas(server):
    _, http = server
    before = _metric(http, "router_requests_total")
    tokens_before = _metric(http, "generation_tokens_total")
    threads = [threading.Thread(target=_complete, args=(http, f"{i} distinct prompt number {i}", 4)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    after = _metric(http, "router_requests_total")
    sent = {replica: after[replica] - before.get(replica, 0.0) for replica in ("0", "1")}
    assert sent["0"] > 0 and sent["1"] > 0 and sum(sent.values()) == 6, sent
    tokens = _metric(http, "generation_tokens_total")
    assert all(tokens[r] > tokens_before.get(r, 0.0) for r in ("0", "1")), (tokens_before, tokens)
    assert _metric(http, "replica_live") == {"0": 1.0, "1": 1.0}
    assert _metric(http, "router_decisions_total", 'reason="cold"')


def test_shared_prefix_stays_on_one_replica(server):
    _, http = server
    shared = list(range(10, 10 + 4 * BLOCK_SIZE))  # four full blocks of one system prompt
    before = _metric(http, "router_requests_total")
    hits_before = _metric(http, "prefix_cache_hits_total")
    for suffix in range(5):
        assert _complete(http, shared + [200 + suffix, 201 + suffix], max_tokens=2).status_code == 200
    after = _metric(http, "router_requests_total")
    sent = {replica: after[replica] - before.get(replica, 0.0) for replica in ("0", "1")}
    assert sorted(sent.values()) == [0.0, 5.0], sent
    holder = max(sent, key=sent.get)
    hits = _metric(http, "prefix_cache_hits_total")
    # The four later requests found the shared blocks cached on that replica.
    assert hits[holder] - hits_before.get(holder, 0.0) >= 4 * 4 * BLOCK_SIZE - 4


def test_client_gone_aborts_on_the_replica(server):
    _, http = server
    body = {"model": MODEL, "prompt": "a client that leaves", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # the first chunk: then hang up
    deadline = time.time() + 20
    while True:  # the replica's engine dropped the request and freed its blocks
        running, used = _metric(http, "num_requests_running"), _metric(http, "num_gpu_blocks_used")
        if not any(running.values()) and not any(used.values()):
            break
        assert time.time() < deadline, (running, used)
        time.sleep(0.1)


def _wait_for_live_replicas(http: httpx.Client, count: int, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while http.get("/health").json().get("live_replicas") != count:
        assert time.time() < deadline, f"not {count} live replicas after {timeout} s"
        time.sleep(0.25)


def test_engine_failure_in_a_replica_runs_its_request_elsewhere(server, monkeypatch):
    import ray

    running, http = server
    replicated = running.app.state.async_engine

    def break_engine(replica) -> None:  # runs in replica 1's actor (pickled by value: a local function)
        def failing_step():
            raise RuntimeError("simulated kernel failure")

        replica.async_engine.engine.step = failing_step

    ray.get(replicated.actors[1].__ray_call__.remote(break_engine))
    choose = replicated.router.choose
    monkeypatch.setattr(replicated.router, "choose", lambda token_ids, loads, **kw: 1 if 1 in loads
                        else choose(token_ids, loads, **kw))
    retries = replicated.num_retries
    result = _stream(http, "a request whose first replica fails", max_tokens=8)
    # Its engine failed before any token: the request ran again on replica 0, whole.
    assert result["error"] is None and result["usage"]["completion_tokens"] == 8, result
    assert replicated.num_retries == retries + 1
    monkeypatch.undo()
    # The failed engine ended its actor; Ray restarted it with a new engine and it rejoined.
    _wait_for_live_replicas(http, 2)
    assert _complete(http, "after the engine failure", max_tokens=4).status_code == 200


def _requests_in_flight(replicated) -> list:
    """The front end's requests in flight, read from another thread (its loop may change the dict meanwhile)."""
    while True:
        try:
            return list(replicated._requests.values())
        except RuntimeError:
            continue


def test_replica_death_mid_answer_reruns_a_non_streamed_request(server, monkeypatch):
    import ray

    running, http = server
    replicated = running.app.state.async_engine
    max_tokens = 400
    plain_prompt, streamed_prompt = "a plain answer that outlives its replica", "a streamed answer that does not"
    expected = _complete(http, plain_prompt, max_tokens).json()["choices"][0]["text"]
    retries = replicated.num_retries
    choose = replicated.router.choose
    monkeypatch.setattr(replicated.router, "choose", lambda token_ids, loads, **kw: 0 if 0 in loads
                        else choose(token_ids, loads, **kw))
    results: dict = {}
    streamed_started = threading.Event()

    def plain() -> None:
        response = _complete(http, plain_prompt, max_tokens)
        results["plain"] = (response.status_code, response.json())

    def streamed() -> None:
        results["streamed"] = _stream(http, streamed_prompt, max_tokens, on_chunk=streamed_started.set)

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for thread in threads:
        thread.start()
    # Both run on replica 0 and both have produced tokens: the streamed one sent some to its client,
    # the plain one's outputs reached the server's handler (which answers only at the end).
    assert streamed_started.wait(30)
    deadline = time.time() + 30
    while not any(r.buffered and r.delivered and r.replica == 0 for r in _requests_in_flight(replicated)):
        assert time.time() < deadline and "plain" not in results, "the plain request produced no output on replica 0"
        time.sleep(0.005)
    ray.kill(replicated.actors[0], no_restart=False)
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a request hung after its replica died"
    status, body = results["plain"]
    # Run again, whole, on replica 1: the same greedy answer as if nothing had happened.
    assert status == 200 and body["choices"][0]["text"] == expected, body
    assert body["usage"]["completion_tokens"] == max_tokens
    stream = results["streamed"]  # its client had tokens already: an error event, then [DONE]
    assert stream["chunks"] >= 1 and stream["done"] and stream["error"]["code"] == "replica_failed", stream
    assert replicated.num_retries == retries + 1
    assert _metric(http, "replica_request_retries_total") == {"": float(replicated.num_retries)}
    monkeypatch.undo()
    _wait_for_live_replicas(http, 2)


def test_killing_a_replica_loses_no_request_and_it_comes_back(server):
    import ray

    running, http = server
    app = running.app
    replicated = app.state.async_engine
    started = threading.Event()
    results: list[dict] = []
    lock = threading.Lock()
    max_tokens = 200

    def streaming(i: int) -> None:
        result = _stream(http, f"stream {i} under load", max_tokens, on_chunk=started.set)
        with lock:
            results.append(result)

    def blocking(i: int) -> None:
        response = _complete(http, f"plain {i} under load", max_tokens)
        body = response.json()
        result = {"status": response.status_code, "error": body.get("error"), "done": True,
                  "usage": body.get("usage")}
        with lock:
            results.append(result)

    threads = [threading.Thread(target=streaming if i % 2 else blocking, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    assert started.wait(30)
    ray.kill(replicated.actors[0], no_restart=False)
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a request hung after its replica died"
    assert len(results) == 12
    # The kill hit replica 0 mid-load: some of its requests failed, or ran again elsewhere.
    assert any(result["error"] for result in results) or replicated.num_retries > 0
    for result in results:
        if result["error"] is None:  # finished: every token is there
            assert result["status"] == 200 and result["done"] and result["usage"]["completion_tokens"] == max_tokens
        else:  # ended with an error the client sees: a 5xx JSON, or an error event before [DONE]
            assert result["error"]["message"] and (result["status"] >= 500 or result["done"]), result
    # Replica 0 leaves routing at once and Ray restarts it; it rejoins once its engine answers.
    _wait_for_live_replicas(http, 2)
    assert _metric(http, "replica_live") == {"0": 1.0, "1": 1.0}
    prompts = [f"after the restart {i}" for i in range(4)]
    for prompt in prompts:
        response = _complete(http, prompt, max_tokens=4)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4


# ----------------------------------------------------------------------------- flags (no Ray needed)


def test_flags_without_ray_name_the_extra(monkeypatch):
    monkeypatch.setattr(data_parallel, "ray_installed", lambda: False)
    with pytest.raises(DataParallelUnavailableError, match=r"pagedllm\[ray\]"):
        DataParallelConfig(data_parallel_size=2).check()
    DataParallelConfig().check()  # one engine in this process: Ray not needed


def test_flags_refuse_what_is_not_there():
    with pytest.raises(DataParallelUnavailableError, match="not available"):
        DataParallelConfig(data_parallel_size=2, distributed_executor_backend="mp").check()
    with pytest.raises(DataParallelUnavailableError, match="--ray-address"):
        DataParallelConfig(ray_address="auto").check()


def test_serve_command_line_refuses_with_the_reason(monkeypatch):
    import argparse

    from pagedllm.entrypoints.serve_cli import add_server_args, server_settings

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    monkeypatch.setattr(data_parallel, "ray_installed", lambda: False)
    with pytest.raises(SystemExit, match=r"need Ray, which is not installed: pip install 'pagedllm\[ray\]'"):
        server_settings(parser.parse_args(["--data-parallel-size", "2"]))
    settings = server_settings(parser.parse_args([]))  # no data-parallel flag: one engine, Ray not asked for
    assert not settings.data_parallel.uses_replicas
