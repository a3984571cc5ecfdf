"""The live dashboard: the paged KV pools, memory waste, queues and latencies in a browser.

``install_dashboard(app, async_engine, title)`` adds GET /dashboard, /dashboard/state and
/dashboard/events to the OpenAI-compatible server; ``pagedllm dashboard --simulate`` serves the
same page over the simulator (entrypoints/dashboard/cli.py).
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.dashboard.hub import DashboardHub
from pagedllm.entrypoints.dashboard.routes import add_dashboard_routes


def install_dashboard(app: Any, async_engine: Any, title: str) -> DashboardHub:
    """Serve the dashboard of ``async_engine`` on ``app``; returns its hub."""
    from pagedllm.entrypoints.dashboard.engine_source import EngineSource, observe_latencies

    if hasattr(async_engine, "capture_replica_snapshot"):  # replicas on Ray: draw one replica's pool
        from pagedllm.entrypoints.dashboard.replica_source import ReplicaSource

        hub = DashboardHub(ReplicaSource(async_engine))
    else:
        hub = DashboardHub(EngineSource(async_engine))
    observe_latencies(async_engine, hub)
    add_dashboard_routes(app, hub, title)
    return hub


__all__ = ["DashboardHub", "add_dashboard_routes", "install_dashboard"]
