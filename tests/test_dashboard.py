"""The dashboard's data: snapshots of hand-built block-manager states, the hub, the HTTP routes.

The browser half (a real Chromium drawing the page) is tests/test_dashboard_browser.py; it
reuses the step gate and the workload defined here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import deque
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from pagedllm.config import EngineArgs
from pagedllm.core.block_manager import BlockSpaceManager
from pagedllm.core.policies import ContiguousBlockManager
from pagedllm.engine.snapshot import CACHED, FREE, OWNED, SHARED, SWAPPED, take_snapshot
from pagedllm.entrypoints.dashboard.hub import DashboardHub
from pagedllm.entrypoints.dashboard.routes import render_page
from pagedllm.entrypoints.dashboard.series import LatencyWindow
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 16
API_KEY = "dash-key"


def make_group(request_id: str, tokens: list[int], first_seq_id: int, max_tokens: int = 100) -> SequenceGroup:
    return SequenceGroup(request_id, [Sequence(first_seq_id, tokens, BS)], SamplingParams(max_tokens=max_tokens),
                         arrival_time=0.0)


def admit(bm: BlockSpaceManager, group: SequenceGroup) -> None:
    """What the scheduler and one prefill step do: allocate, run, offer full blocks to the prefix cache."""
    bm.allocate(group)
    for seq in group.seqs:
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = seq.get_len()
        bm.mark_computed(seq)


def fake_scheduler(bm, running=(), swapped=(), waiting=()) -> SimpleNamespace:
    return SimpleNamespace(block_manager=bm, running=deque(running), swapped=deque(swapped), waiting=deque(waiting))


def counts(map_: dict) -> dict[int, int]:
    return {state: map_["state"].count(state) for state in (FREE, CACHED, OWNED, SHARED, SWAPPED)}


# ---------------------------------------------------------------------------------- snapshots


def test_forked_blocks_are_shared_and_counted_per_request():
    bm = BlockSpaceManager(BS, num_gpu_blocks=32, num_cpu_blocks=0, watermark=0.0, enable_prefix_caching=False)
    group = make_group("a", list(range(40)), 0)  # 16 + 16 + 8 tokens: 3 blocks
    admit(bm, group)
    parent = group.seqs[0]
    for child_id in (1, 2):  # parallel samples: two forks share every block
        child = parent.fork(child_id)
        group.seqs.append(child)
        bm.fork(parent, child)
    snap = take_snapshot(fake_scheduler(bm, running=[group]))
    assert snap["blocks"] == {"total": 32, "free": 29, "used": 3, "shared": 3, "cached": 0, "swapped": 0,
                              "allocatable": 29, "cpu_total": 0}
    assert snap["map"]["state"][:4] == [SHARED, SHARED, SHARED, FREE]
    assert snap["map"]["ref"][:4] == [3, 3, 3, 0]
    assert snap["map"]["fill"][:4] == [16, 16, 8, 0]
    assert snap["map"]["owner"][:4] == [0, 0, 0, -1]
    assert snap["sharing"]["saved_by_forks"] == 6 and snap["sharing"]["saved_by_prefix"] == 0
    assert snap["requests"] == [{"id": "a", "state": "running", "prompt_tokens": 40, "output_tokens": 0,
                                 "num_seqs": 3, "blocks": 3, "shared_blocks": 3, "preemptions": 0}]
    # Copy-on-write of the partial block for one sample: one private copy, the rest still shared.
    group.seqs[1].append_token(7, 0.0)
    assert bm.append_slots(group.seqs[1]) == [(2, 3)]
    snap = take_snapshot(fake_scheduler(bm, running=[group]))
    assert snap["blocks"]["used"] == 4 and snap["blocks"]["shared"] == 3
    assert snap["map"]["state"][:4] == [SHARED, SHARED, SHARED, OWNED]
    assert snap["map"]["ref"][:4] == [3, 3, 2, 1]
    assert snap["map"]["fill"][3] == 9  # the copy holds the 8 prompt tokens plus the new one
    assert snap["sharing"]["saved_by_forks"] == 5


def test_cached_prefix_blocks_evictable_then_shared_across_requests():
    bm = BlockSpaceManager(BS, num_gpu_blocks=16, num_cpu_blocks=0, watermark=0.0, enable_prefix_caching=True)
    prefix = list(range(100, 132))  # two full blocks
    first = make_group("first", prefix + [1, 2, 3], 0)
    admit(bm, first)
    bm.free(first.seqs[0])  # finished: its two full blocks stay cached, the partial one is freed
    snap = take_snapshot(fake_scheduler(bm))
    assert snap["blocks"]["cached"] == 2 and snap["blocks"]["used"] == 0 and snap["blocks"]["free"] == 14
    assert snap["blocks"]["allocatable"] == 16
    assert snap["map"]["state"][:3] == [CACHED, CACHED, FREE]
    assert snap["map"]["fill"][:2] == [BS, BS]

    second = make_group("second", prefix + [4, 5], 1)
    third = make_group("third", prefix + [6], 2)
    admit(bm, second)
    admit(bm, third)
    snap = take_snapshot(fake_scheduler(bm, running=[second, third]))
    # Two hits shared by both requests (ref 2), one private last block each.
    assert snap["blocks"] == {"total": 16, "free": 12, "used": 4, "shared": 2, "cached": 0, "swapped": 0,
                              "allocatable": 12, "cpu_total": 0}
    assert snap["map"]["state"][:2] == [SHARED, SHARED]
    assert snap["map"]["owners"] == {"0": [0, 1], "1": [0, 1]}
    assert snap["sharing"]["saved_by_prefix"] == 2 and snap["sharing"]["saved_by_forks"] == 0
    assert [r["shared_blocks"] for r in snap["requests"]] == [2, 2]
    assert snap["sharing"]["prefix_hit_tokens"] == 64


def test_swapped_blocks_counted_in_the_cpu_pool():
    bm = BlockSpaceManager(BS, num_gpu_blocks=8, num_cpu_blocks=8, watermark=0.0, enable_prefix_caching=False)
    running = make_group("run", list(range(20)), 0)
    swapped = make_group("swap", list(range(50, 90)), 1)
    admit(bm, running)
    admit(bm, swapped)
    parent = swapped.seqs[0]
    child = parent.fork(2)
    swapped.seqs.append(child)
    bm.fork(parent, child)
    bm.swap_out(swapped)
    for seq in swapped.seqs:
        seq.status = SequenceStatus.SWAPPED
    waiting = make_group("wait", [1, 2, 3], 3)
    snap = take_snapshot(fake_scheduler(bm, running=[running], swapped=[swapped], waiting=[waiting]))
    assert snap["blocks"] == {"total": 8, "free": 6, "used": 2, "shared": 0, "cached": 0, "swapped": 3,
                              "allocatable": 6, "cpu_total": 8}
    assert counts(snap["cpu_map"]) == {FREE: 5, CACHED: 0, OWNED: 0, SHARED: 0, SWAPPED: 3}
    assert snap["cpu_map"]["ref"][:3] == [2, 2, 2]  # the two samples still share the swapped blocks
    assert snap["sharing"]["saved_by_forks"] == 3
    assert snap["queues"] == {"running": 1, "waiting": 1, "swapped": 1}
    rows = {r["id"]: r for r in snap["requests"]}
    assert rows["swap"]["state"] == "swapped" and rows["swap"]["blocks"] == 3 and rows["swap"]["shared_blocks"] == 3
    assert rows["wait"]["state"] == "waiting" and rows["wait"]["blocks"] == 0


def test_waste_categories_at_an_instant():
    bm = BlockSpaceManager(BS, num_gpu_blocks=10, num_cpu_blocks=0, watermark=0.0, enable_prefix_caching=False)
    capped = make_group("capped", list(range(40)), 0, max_tokens=3)  # 8 free slots left, only 3 can be written
    growing = make_group("growing", list(range(20)), 1, max_tokens=100)
    admit(bm, capped)
    admit(bm, growing)
    waste = take_snapshot(fake_scheduler(bm, running=[capped, growing]))["waste"]
    assert waste == {"token": 60, "reserved": 3 + 12, "internal": 5, "external": 0, "free": 5 * BS, "total": 160}


def test_contiguous_baseline_snapshot_shows_reservations():
    bm = ContiguousBlockManager("contiguous-max", BS, num_gpu_blocks=64, max_model_len=256)
    group = make_group("orca", list(range(20)), 0, max_tokens=50)
    bm.allocate(group)
    for seq in group.seqs:
        seq.status = SequenceStatus.RUNNING
    snap = take_snapshot(fake_scheduler(bm, running=[group]), max_model_len=256)
    assert snap["kv_allocation"] == "contiguous-max"
    assert snap["blocks"]["used"] == 16  # a run for the whole 256-token context
    assert snap["map"]["fill"][:3] == [16, 4, 0]
    waste = snap["waste"]
    assert waste["token"] == 20 and waste["reserved"] == 50 and waste["internal"] == 256 - 70


def test_snapshot_reads_only_and_is_plain_json():
    bm = BlockSpaceManager(BS, num_gpu_blocks=16, num_cpu_blocks=4, watermark=0.0, enable_prefix_caching=True)
    group = make_group("a", list(range(33)), 0)
    admit(bm, group)
    before = bm.get_stats()
    snap = take_snapshot(fake_scheduler(bm, running=[group]))
    bm.check_invariants()
    assert bm.get_stats() == before
    assert json.loads(json.dumps(snap)) == snap
    snap["map"]["ref"][0] = 99  # the snapshot's lists are its own
    assert bm.gpu_allocator.blocks[0].ref_count == 1


def test_latency_window_percentiles_forget_old_samples():
    window = LatencyWindow(window_s=10.0)
    for i in range(100):
        window.record(float(i) / 10, float(i + 1))  # values 1..100 at t = 0..9.9
    assert window.percentiles(9.9) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert window.percentiles(15.0)["p50"] == 75.0  # only t >= 5.0 remain: values 51..100, 25th of 50
    assert window.percentiles(100.0) == {"p50": None, "p90": None, "p99": None}


def test_stepped_simulation_shares_frees_and_times_tokens():
    from pagedllm.entrypoints.dashboard.simulated import SteppedSimulation
    from pagedllm.simulator import CostModel, SimConfig, TraceRequest, get_hardware, get_model_shape

    def trace(round_index: int) -> list[TraceRequest]:
        return [TraceRequest(f"q{i}", prompt_len=40, output_len=12, arrival_time=0.05 * i, n=2) for i in range(6)]

    cost_model = CostModel.from_hardware(get_model_shape("opt-13b"), get_hardware("a100-40gb"))
    config = SimConfig(block_size=BS, num_gpu_blocks=64, enable_prefix_caching=True, max_model_len=2048)
    sim = SteppedSimulation(trace, cost_model, config, shared_prefix_len=32)
    ttfts, itls = [], []
    sim.on_ttft = lambda now, seconds: ttfts.append(seconds)
    sim.on_itl = lambda now, seconds: itls.append(seconds)
    saved = {"saved_by_forks": 0, "saved_by_prefix": 0}
    for _ in range(500):
        if sim.round == 1 and sim.next_arrival == len(sim.pending) and not sim.scheduler.has_unfinished_seqs():
            break
        sim.step()
        sharing = take_snapshot(sim.scheduler, sim.max_len)["sharing"]
        for name in saved:
            saved[name] = max(saved[name], sharing[name])
    else:
        raise AssertionError("the first round did not finish")
    assert sim.scheduler.block_manager.all_free()
    assert saved["saved_by_forks"] > 0 and saved["saved_by_prefix"] > 0  # samples and the common prefix
    assert len(ttfts) == 6 and len(itls) == 6 * 11 and min(itls) > 0
    assert sim.counters()["generation_tokens"] == 6 * 2 * 12
    snap = take_snapshot(sim.scheduler, sim.max_len)
    assert snap["blocks"]["cached"] > 0 and snap["blocks"]["used"] == 0
    sim.step()  # a used-up trace is followed by the next round: the picture never goes still
    assert sim.round == 2 and sim.pending[0].request_id.startswith("r1-")


# ---------------------------------------------------------------------------------- the hub


class CountingSource:
    def __init__(self) -> None:
        bm = BlockSpaceManager(BS, num_gpu_blocks=8, num_cpu_blocks=0)
        self.scheduler = fake_scheduler(bm)
        self.captures = 0
        self.alive = True

    def now(self) -> float:
        return time.time()

    def is_alive(self) -> bool:
        return self.alive

    async def capture(self) -> dict:
        self.captures += 1
        snap = take_snapshot(self.scheduler)
        snap["counters"] = {"prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0}
        return snap


def test_hub_works_only_while_watched_and_coalesces():
    async def main() -> None:
        source = CountingSource()
        hub = DashboardHub(source, interval_s=0.02)
        hub.record_itl(0.0, 1.0)
        await asyncio.sleep(0.2)
        assert source.captures == 0 and not hub.itl.samples  # nobody watching: no work, nothing kept

        events = hub.events()
        assert (await anext(events)).startswith(b"event: history\ndata: []")
        assert hub.active
        first = await anext(events)
        assert first.startswith(b"event: state\n")
        assert json.loads(first.split(b"data: ", 1)[1])["blocks"]["total"] == 8
        await asyncio.sleep(0.3)  # a slow viewer: many ticks pass, one payload waits
        assert source.captures >= 5
        assert (await anext(events)).startswith(b"event: state\n")
        assert len(hub.history) >= 5
        await events.aclose()
        await asyncio.sleep(0.05)
        stopped_at = source.captures
        await asyncio.sleep(0.2)
        assert source.captures == stopped_at and not hub.active

        # A stopped source ends the stream with an "end" event.
        events = hub.events()
        await anext(events)
        source.alive = False
        rest = [chunk async for chunk in events]
        assert rest[-1].startswith(b"event: end\n")

    asyncio.run(main())


class EngineBackedSource(CountingSource):
    """Shaped as EngineSource: the engine (and its kv_cache_info) behind ``async_engine.engine``."""

    def __init__(self, info: dict) -> None:
        super().__init__()
        self.async_engine = SimpleNamespace(engine=SimpleNamespace(kv_cache_info=info))


def test_hub_adds_the_pool_format_and_size_to_each_state():
    info = {"kv_cache_dtype": "int8", "kv_cache_storage": "int8", "kv_bytes_per_token": 160,
            "kv_block_bytes": 160 * BS, "kv_gpu_pool_bytes": 160 * BS * 8, "kv_cpu_pool_bytes": 0,
            "block_size": BS, "tensor_parallel_size": 1}
    expected = {"dtype": "int8", "storage": "int8", "bytes_per_token": 160, "block_bytes": 160 * BS,
                "pool_bytes": 160 * BS * 8, "cpu_pool_bytes": 0, "block_size": BS, "tensor_parallel_size": 1}

    async def main() -> None:
        state = await DashboardHub(EngineBackedSource(info)).state()
        assert state["kv_cache"] == expected and state["blocks"]["total"] == 8
        json.dumps(state)  # plain JSON, as the stream sends it
        # Handed to the hub directly (a source without an engine, such as the simulator's).
        assert (await DashboardHub(CountingSource(), kv_cache=info).state())["kv_cache"] == expected
        # A source that does not know its pool's format: the page shows the block counts only.
        assert "kv_cache" not in await DashboardHub(CountingSource()).state()

    asyncio.run(main())


def test_page_is_self_contained():
    page = render_page({"title": "t</script>x", "interval_s": 0.25})
    assert "/*__" not in page  # every placeholder filled
    assert "http://" not in page and "https://" not in page  # nothing fetched from elsewhere
    assert page.count("</script>") == 2  # the title cannot close a script element
    assert "new EventSource" in page and "getContext('2d')" in page
    for element in ("kv-dtype", "kv-bytes-per-token", "kv-gpu-blocks", "kv-cpu-blocks"):  # the pool's panel
        assert f'id="{element}"' in page, element


# ---------------------------------------------------------------------------------- the server

# The engine of the server tests below (and the browser test) runs only the steps a test allows:
# between them it stands still with its requests in flight, so the expected block counts are exact.


class StepGate:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.real_step = engine.step
        self.allowed = 0
        self.done = 0
        self.open = False
        self.lock = threading.Lock()
        engine.step = self.step

    def step(self):
        with self.lock:
            run = self.open or self.done < self.allowed
        if not run:
            time.sleep(0.01)  # the loop calls again; snapshots queue up between these calls
            return []
        outputs = self.real_step()
        with self.lock:
            self.done += 1
        return outputs

    def run_steps(self, num_steps: int, timeout: float = 120.0) -> None:  # a first step may build kernels
        with self.lock:
            self.allowed = self.done + num_steps
        deadline = time.time() + timeout
        while self.done < self.allowed:
            assert time.time() < deadline, f"the engine ran {self.done} of {self.allowed} steps"
            time.sleep(0.005)

    def release(self) -> None:
        with self.lock:
            self.open = True


def wait_for(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@contextlib.contextmanager
def gated_server_running(model_path: str) -> Iterator[SimpleNamespace]:
    """A server (tiny Llama, 64 blocks of 16, an API key) whose engine steps only when told."""
    from test_server import ServerThread

    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.openai.api_server import build_app

    args = EngineArgs(model=model_path, num_kv_blocks=64, block_size=BS, device="cpu", dtype="float32",
                      max_num_seqs=16, num_threads=1)
    engine = LLMEngine.from_engine_args(args)
    gate = StepGate(engine)
    app = build_app(engine=engine, served_model_name="tiny", api_key=API_KEY, log_requests=False)
    with ServerThread(app) as server:
        try:
            yield SimpleNamespace(url=server.url, engine=engine, gate=gate, app=app, threads=[])
        finally:
            gate.release()  # let the requests in flight finish, so the server stops at once


@pytest.fixture
def gated_server(tiny_model_factory):
    with gated_server_running(tiny_model_factory("llama")) as server:
        yield server


def post_completion(url: str, prompt: list[int], **extra) -> threading.Thread:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 1.0, "ignore_eos": True,
            "seed": 1, **extra}

    def send() -> None:
        httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def run_sharing_workload(server) -> dict:
    """Parallel samples (n=3) of one prompt, and two requests sharing a two-block prefix, frozen mid-flight.

    Returns the block counts worked out by hand (and checked against the allocator).
    """
    engine, gate = server.engine, server.gate
    scheduler = engine.scheduler
    prefix = list(range(100, 132))
    threads = [post_completion(server.url, list(range(10, 50)), n=3),  # 40 tokens: blocks of 16, 16, 8
               post_completion(server.url, prefix + list(range(140, 148)))]
    wait_for(lambda: len(scheduler.waiting) == 2, what="two queued requests")
    gate.run_steps(3)  # the prefill of both (and the forks of the n=3 group), then two decodes
    threads.append(post_completion(server.url, prefix + list(range(150, 158))))
    wait_for(lambda: len(scheduler.waiting) == 1, what="the third request")
    gate.run_steps(2)  # its prefill (hitting the cached prefix of the second request) with the others' decodes,
    # then one decode of all three
    # n=3: 2 full prompt blocks shared by the 3 samples + 3 private last blocks (copy-on-write).
    # Prefix: the 2 prefix blocks shared by 2 requests + 1 last block each. Nothing else is held.
    expected = {"used": 5 + 4, "shared": 2 + 2, "owned": 3 + 2, "cached": 0, "swapped": 0}
    expected["free"] = 64 - expected["used"]
    allocator = scheduler.block_manager.gpu_allocator
    assert (allocator.num_used, allocator.num_shared) == (expected["used"], expected["shared"])
    server.threads = threads
    return expected


def test_state_endpoint_with_requests_in_flight(gated_server):
    expected = run_sharing_workload(gated_server)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=gated_server.url, timeout=30) as client:
        assert client.get("/dashboard/state").status_code == 401
        assert client.get("/dashboard").status_code == 401
        assert client.get("/v1/models", params={"key": API_KEY}).status_code == 401  # ?key= is for /dashboard only
        assert client.get("/dashboard/state", params={"key": "wrong"}).status_code == 401
        page = client.get("/dashboard", params={"key": API_KEY})
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        state = client.get("/dashboard/state", headers=headers).json()
    blocks = state["blocks"]
    assert {name: blocks[name] for name in ("used", "shared", "cached", "swapped", "free")} == \
        {name: expected[name] for name in ("used", "shared", "cached", "swapped", "free")}
    assert state["queues"] == {"running": 3, "waiting": 0, "swapped": 0}
    assert state["sharing"]["saved_by_forks"] == 4 and state["sharing"]["saved_by_prefix"] == 2
    # The n=3 request and the first prefix request arrived together (either order), then the third.
    assert sorted((r["state"], r["num_seqs"], r["blocks"], r["shared_blocks"]) for r in state["requests"]) == \
        [("running", 1, 3, 2), ("running", 1, 3, 2), ("running", 3, 5, 2)]
    assert state["waste"]["token"] > 0 and state["waste"]["external"] == 0
    assert state["counters"]["steps"] == 5
    # The tiny Llama in float32: 2 layers x K and V x 2 KV heads x 16 dims x 4 bytes a token.
    assert state["kv_cache"]["dtype"] == "auto" and state["kv_cache"]["storage"] == "float32"
    assert state["kv_cache"]["bytes_per_token"] == 512 and state["kv_cache"]["pool_bytes"] == 512 * BS * 64
