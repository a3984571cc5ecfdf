"""Data-parallel replicas as dashboard sources: each replica's pool, and all of them together.

Each replica has its own KV pool and queues. ``ReplicaSource`` draws one replica (its snapshot is
taken in its actor between two of its steps, as EngineSource does in-process); ``AllReplicasSource``
draws every live replica at once: their pools side by side in one map, their queues, memory
categories, sharing and counters summed (merge.py). A replica that is down is not an error: its
view answers a ``down`` document (with the reason) that the page shows as such, until the replica
is back. Every document names its ``view`` and lists the replicas with their live state, which is
what the page's replica selector shows.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from pagedllm.entrypoints.dashboard.hub import source_kv_cache
from pagedllm.entrypoints.dashboard.merge import merge_snapshots
from pagedllm.serving.replica_errors import ReplicaUnavailableError

ALL_REPLICAS = "all"  # the view of every replica together


class ReplicaSet(Protocol):
    """What the replica views read off the replicated engine (serving/replica_frontend.py)."""

    @property
    def has_stopped(self) -> bool: ...

    def replica_states(self) -> list[dict[str, Any]]: ...

    async def capture_replica_snapshot(self, replica: int) -> dict[str, Any]:
        """Raises ReplicaUnavailableError while the replica is down."""


def down_document(view: str, replicas: list[dict[str, Any]], reason: str) -> dict[str, Any]:
    """The state of a view with nothing to draw: the page shows the reason in place of the pool."""
    return {"view": view, "replicas": replicas, "down": reason}


class _ReplicaSetSource:
    """What every replica view shares: the wall clock, and life as long as the replicated engine's."""

    def __init__(self, replicas: ReplicaSet, kv_cache_info: dict[str, Any] | None = None) -> None:
        self.replicas = replicas
        # The pool's format and size, the same on every replica (source_kv_cache reads it).
        self.kv_cache_info = kv_cache_info

    def now(self) -> float:
        return time.time()

    def is_alive(self) -> bool:
        return not self.replicas.has_stopped


class ReplicaSource(_ReplicaSetSource):
    """One replica's pool and queues (``view`` is its number as text, as ``?replica=`` takes it)."""

    def __init__(self, replicas: ReplicaSet, replica: int, kv_cache_info: dict[str, Any] | None = None) -> None:
        super().__init__(replicas, kv_cache_info)
        self.replica = replica
        self.view = str(replica)

    async def capture(self) -> dict[str, Any]:
        try:
            snapshot = await self.replicas.capture_replica_snapshot(self.replica)
        except ReplicaUnavailableError as exc:
            return down_document(self.view, self.replicas.replica_states(), str(exc))
        snapshot["view"] = self.view
        snapshot["replicas"] = self.replicas.replica_states()
        return snapshot


class AllReplicasSource(_ReplicaSetSource):
    """Every live replica together: one map of all their pools (``segments`` says whose blocks are where)."""

    view = ALL_REPLICAS

    async def capture(self) -> dict[str, Any]:
        states = self.replicas.replica_states()
        live = [state["replica"] for state in states if state["live"]]

        async def one(replica: int) -> dict[str, Any] | None:
            try:
                return await self.replicas.capture_replica_snapshot(replica)
            except ReplicaUnavailableError:  # went down since: drawn without it this time
                return None

        results = await asyncio.gather(*(one(replica) for replica in live))
        snapshots = {replica: snapshot for replica, snapshot in zip(live, results) if snapshot is not None}
        states = self.replicas.replica_states()
        if not snapshots:
            return down_document(self.view, states, "No replica is live right now; Ray is restarting them.")
        merged = merge_snapshots(snapshots)
        if self.kv_cache_info is not None:
            merged["kv_cache"] = source_kv_cache(self, _pools_together(self.kv_cache_info, len(snapshots)))
        merged["view"] = self.view
        merged["replicas"] = states
        return merged


def _pools_together(kv_cache_info: dict[str, Any], num_pools: int) -> dict[str, Any]:
    """One replica's pool stats (engine names) with the pools' bytes of ``num_pools`` replicas."""
    info = dict(kv_cache_info)
    for name in ("kv_gpu_pool_bytes", "kv_cpu_pool_bytes"):
        if isinstance(info.get(name), (int, float)):
            info[name] *= num_pools
    return info
