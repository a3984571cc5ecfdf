"""The live dashboard: the paged KV pools, memory waste, queues and latencies in a browser.

``install_dashboard(app, async_engine, title)`` adds GET /dashboard, /dashboard/state,
/dashboard/events and /dashboard/replicas to the OpenAI-compatible server; ``pagedllm dashboard
--simulate`` serves the same page over the simulator (entrypoints/dashboard/cli.py).
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.dashboard.hub import DashboardHub
from pagedllm.entrypoints.dashboard.routes import add_dashboard_routes
from pagedllm.entrypoints.dashboard.views import DashboardViews


def install_dashboard(app: Any, async_engine: Any, title: str) -> DashboardViews:
    """Serve the dashboard of ``async_engine`` on ``app``; returns its views (one hub each)."""
    from pagedllm.entrypoints.dashboard.engine_source import EngineSource, observe_latencies

    if hasattr(async_engine, "capture_replica_snapshot"):  # replicas on Ray: all together, or one by one
        views = replica_views(async_engine)
        replica_of = async_engine.replica_of
        everyone = views.hubs[views.default]

        def hubs_of(output: Any) -> tuple[DashboardHub, ...]:
            replica = replica_of(output.request_id)
            hub = views.hubs.get(str(replica)) if replica is not None else None
            return (everyone,) if hub is None else (everyone, hub)

        observe_latencies(async_engine, hubs_of)
    else:
        hub = DashboardHub(EngineSource(async_engine))
        views = DashboardViews.single(hub)
        observe_latencies(async_engine, lambda output: (hub,))
    add_dashboard_routes(app, views, title)
    return views


def replica_views(replicas: Any) -> DashboardViews:
    """The views of a replicated engine: ``all`` (the default) and one per replica."""
    from pagedllm.entrypoints.dashboard.replica_source import ALL_REPLICAS, AllReplicasSource, ReplicaSource

    info = dict(replicas.engine.kv_cache_info)
    hubs = {ALL_REPLICAS: DashboardHub(AllReplicasSource(replicas, info))}
    for replica in range(replicas.num_replicas):
        hubs[str(replica)] = DashboardHub(ReplicaSource(replicas, replica, info))
    return DashboardViews(hubs, ALL_REPLICAS, replicas.replica_states)


__all__ = ["DashboardHub", "DashboardViews", "add_dashboard_routes", "install_dashboard", "replica_views"]
