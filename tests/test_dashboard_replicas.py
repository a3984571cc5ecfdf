"""The dashboard's replica views (all together, one by one, a dead one) over two block managers.

Two hand-built block-manager states stand in for two replicas' engines (``PoolsAsReplicas``
answers what the views read off ReplicatedEngine: replica_states, capture_replica_snapshot,
has_stopped), so the routes, the merge and the dead-replica document are checked exactly and in
milliseconds. The same views over real Ray replicas: tests/test_ray_replicas.py; the selector in
a browser: tests/test_dashboard_browser.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from test_dashboard import BS, admit, fake_scheduler, make_group

from pagedllm.core.block_manager import BlockSpaceManager
from pagedllm.engine.snapshot import FREE, SHARED, take_snapshot
from pagedllm.entrypoints.dashboard import replica_views
from pagedllm.entrypoints.dashboard.hub import DashboardHub
from pagedllm.entrypoints.dashboard.merge import merge_snapshots
from pagedllm.entrypoints.dashboard.routes import add_dashboard_routes
from pagedllm.serving.replica_errors import ReplicaUnavailableError

KV_INFO = {"kv_cache_dtype": "auto", "kv_cache_storage": "float32", "kv_bytes_per_token": 512,
           "kv_block_bytes": 512 * BS, "kv_gpu_pool_bytes": 512 * BS * 16, "kv_cpu_pool_bytes": 0}


def forked_replica() -> SimpleNamespace:
    """Replica 0: one request of 3 parallel samples of a 40-token prompt (3 blocks shared 3 ways)."""
    bm = BlockSpaceManager(BS, num_gpu_blocks=16, num_cpu_blocks=0, watermark=0.0, enable_prefix_caching=False)
    group = make_group("forked", list(range(40)), 0)
    admit(bm, group)
    for child_id in (1, 2):
        child = group.seqs[0].fork(child_id)
        group.seqs.append(child)
        bm.fork(group.seqs[0], child)
    return fake_scheduler(bm, running=[group])


def prefix_replica() -> SimpleNamespace:
    """Replica 1: two requests sharing a two-block cached prefix, one more waiting."""
    bm = BlockSpaceManager(BS, num_gpu_blocks=16, num_cpu_blocks=0, watermark=0.0, enable_prefix_caching=True)
    prefix = list(range(100, 132))
    first, second = make_group("p1", prefix + [1], 0), make_group("p2", prefix + [2, 3], 1)
    admit(bm, first)
    admit(bm, second)
    return fake_scheduler(bm, running=[first, second], waiting=[make_group("queued", [5, 6], 2)])


class PoolsAsReplicas:
    """Schedulers standing in for replicas' engines: the dashboard's ReplicaSet."""

    def __init__(self, schedulers: list[SimpleNamespace]) -> None:
        self.schedulers = schedulers
        self.live = [True] * len(schedulers)
        self.has_stopped = False
        self.engine = SimpleNamespace(kv_cache_info=KV_INFO)
        self.captures = [0] * len(schedulers)
        self.output_observer = None  # chained by install_dashboard, as on ReplicatedEngine
        self.running_on: dict[str, int] = {}

    @property
    def num_replicas(self) -> int:
        return len(self.schedulers)

    def replica_states(self) -> list[dict]:
        return [{"replica": replica, "live": live} for replica, live in enumerate(self.live)]

    def replica_of(self, request_id: str) -> int | None:
        return self.running_on.get(request_id)

    async def capture_replica_snapshot(self, replica: int) -> dict:
        if not self.live[replica]:
            raise ReplicaUnavailableError(f"Replica {replica} is down; Ray is restarting it.")
        self.captures[replica] += 1
        snapshot = take_snapshot(self.schedulers[replica])
        snapshot["counters"] = {"prompt_tokens": 100 * (replica + 1), "generation_tokens": 10, "preemptions": replica,
                                "steps": 3}
        snapshot["replica"] = replica
        return snapshot


def replicas_app(replicas: PoolsAsReplicas) -> FastAPI:
    app = FastAPI()
    add_dashboard_routes(app, replica_views(replicas), "two replicas")
    return app


@pytest.fixture
def replicas() -> PoolsAsReplicas:
    return PoolsAsReplicas([forked_replica(), prefix_replica()])


def test_each_replica_view_draws_that_replica(replicas):
    with TestClient(replicas_app(replicas)) as client:
        listed = client.get("/dashboard/replicas").json()
        assert listed == {"views": ["all", "0", "1"], "default": "all",
                          "replicas": [{"replica": 0, "live": True}, {"replica": 1, "live": True}]}
        first = client.get("/dashboard/state", params={"replica": "0"}).json()
        second = client.get("/dashboard/state", params={"replica": "1"}).json()
    assert (first["view"], first["replica"], second["view"], second["replica"]) == ("0", 0, "1", 1)
    assert first["blocks"]["used"] == 3 and first["blocks"]["shared"] == 3 and first["queues"]["running"] == 1
    assert second["blocks"]["used"] == 4 and second["blocks"]["shared"] == 2
    assert second["queues"] == {"running": 2, "waiting": 1, "swapped": 0}
    assert [r["id"] for r in second["requests"]] == ["p1", "p2", "queued"]
    assert first["replicas"] == listed["replicas"] and first["kv_cache"]["pool_bytes"] == 512 * BS * 16
    assert first["counters"]["prompt_tokens"] == 100 and second["counters"]["prompt_tokens"] == 200


def test_all_view_puts_the_pools_side_by_side_and_sums(replicas):
    with TestClient(replicas_app(replicas)) as client:
        merged = client.get("/dashboard/state").json()  # the default view
        assert client.get("/dashboard/state", params={"replica": "ALL"}).json()["view"] == "all"
    assert merged["view"] == "all" and "replica" not in merged
    assert merged["segments"] == [{"replica": 0, "start": 0, "cpu_start": 0, "blocks": 16, "cpu_blocks": 0},
                                  {"replica": 1, "start": 16, "cpu_start": 0, "blocks": 16, "cpu_blocks": 0}]
    assert len(merged["map"]["state"]) == 32
    assert merged["blocks"] == {"total": 32, "free": 25, "used": 7, "shared": 5, "cached": 0, "swapped": 0,
                                "allocatable": 25, "cpu_total": 0}
    assert merged["queues"] == {"running": 3, "waiting": 1, "swapped": 0}
    assert merged["counters"] == {"prompt_tokens": 300, "generation_tokens": 20, "preemptions": 1, "steps": 6}
    assert [(r["replica"], r["id"]) for r in merged["requests"]] == [(0, "forked"), (1, "p1"), (1, "p2"),
                                                                     (1, "queued")]
    # Replica 1's block 0 is block 16 here, its owners shifted past replica 0's one request.
    assert merged["map"]["state"][16:18] == [SHARED, SHARED] and merged["map"]["owners"]["16"] == [1, 2]
    assert merged["map"]["owner"][:3] == [0, 0, 0] and merged["map"]["state"][3] == FREE
    assert merged["waste"]["total"] == 2 * 16 * BS
    # Both pools' bytes, under the snapshot's names.
    assert merged["kv_cache"]["pool_bytes"] == 2 * 512 * BS * 16 and merged["kv_cache"]["bytes_per_token"] == 512
    json.dumps(merged)


def test_a_dead_replica_is_shown_dead_not_an_error(replicas):
    replicas.live[1] = False
    with TestClient(replicas_app(replicas)) as client:
        response = client.get("/dashboard/state", params={"replica": "1"})
        assert response.status_code == 200
        down = response.json()
        merged = client.get("/dashboard/state", params={"replica": "all"}).json()
        assert client.get("/dashboard/replicas").json()["replicas"][1] == {"replica": 1, "live": False}
        replicas.live[0] = False
        nothing = client.get("/dashboard/state").json()
    assert down["view"] == "1" and "Replica 1 is down" in down["down"] and "map" not in down
    assert down["replicas"] == [{"replica": 0, "live": True}, {"replica": 1, "live": False}]
    # The aggregate draws the live replica alone.
    assert [s["replica"] for s in merged["segments"]] == [0] and merged["blocks"]["total"] == 16
    assert merged["kv_cache"]["pool_bytes"] == 512 * BS * 16
    assert nothing["view"] == "all" and "No replica is live" in nothing["down"]


def test_a_view_that_is_not_there_is_a_400(replicas):
    with TestClient(replicas_app(replicas)) as client:
        for bad in ("2", "-1", "first"):
            for path in ("/dashboard/state", "/dashboard/events"):
                response = client.get(path, params={"replica": bad})
                assert response.status_code == 400, (path, bad)
                error = response.json()["error"]
                assert error["param"] == "replica" and "all, 0, 1" in error["message"]
    assert replicas.captures == [0, 0]

    class OneEngine:
        def now(self) -> float:
            return 0.0

        def is_alive(self) -> bool:
            return True

        async def capture(self) -> dict:
            raise AssertionError("not reached")

    single = FastAPI()
    add_dashboard_routes(single, DashboardHub(OneEngine()), "one engine")
    with TestClient(single) as client:
        assert client.get("/dashboard/replicas").json() == {"views": [], "default": None, "replicas": []}
        response = client.get("/dashboard/state", params={"replica": "0"})
        assert response.status_code == 400 and "one engine" in response.json()["error"]["message"]


def test_each_view_keeps_its_own_series(replicas):
    import asyncio

    views = replica_views(replicas)

    async def main() -> None:
        for _ in range(3):
            await views.hub("1").state()
        await views.hub("all").state()
        # Only the views asked did any work, each into its own rates.
        assert replicas.captures == [1, 4]
        assert not views.hub("0").rates.readings and len(views.hub("1").rates.readings) == 3
        replicas.live[0] = False
        down = await views.hub("0").state()
        assert "down" in down and "point" not in down  # no chart point for a replica that is down

    asyncio.run(main())


def test_latencies_go_to_the_all_view_and_the_request_replica(replicas):
    import asyncio

    from pagedllm.engine.async_engine import RequestTiming
    from pagedllm.entrypoints.dashboard import install_dashboard

    async def main() -> None:
        views = install_dashboard(FastAPI(), replicas, "two replicas")
        watching = [views.hub(view).events() for view in ("all", "0", "1")]
        for events in watching:  # a viewer on each view: their recorders are on
            await anext(events)
        replicas.running_on["req-1"] = 1
        timing = RequestTiming(100.0)
        replicas.output_observer(SimpleNamespace(request_id="req-1"), timing, 100.5, 1)  # its first token
        timing.first_token_time = timing.last_token_time = 100.5
        replicas.output_observer(SimpleNamespace(request_id="req-1"), timing, 100.75, 1)
        for view, expected in (("all", 1), ("1", 1), ("0", 0)):
            hub = views.hub(view)
            assert (len(hub.ttft.samples), len(hub.itl.samples)) == (expected, expected), view
        assert views.hub("1").ttft.samples[0] == (100.5, 0.5) and views.hub("1").itl.samples[0] == (100.75, 0.25)
        for events in watching:
            await events.aclose()

    asyncio.run(main())


def test_merge_needs_a_snapshot():
    with pytest.raises(ValueError, match="at least one"):
        merge_snapshots({})
