"""DashboardHub: one snapshot per tick, shared by every viewer, and nothing at all without viewers.

A ticker task runs only while at least one Server-Sent-Events client is connected: each tick it
asks the source for one snapshot (taken between engine steps), adds the derived series (token
rates, latency percentiles, a history point), encodes it once and hands the same bytes to every
subscriber. A subscriber keeps only the newest payload, so a slow browser skips updates instead
of queueing them (coalescing). When the last subscriber leaves, the ticker stops and the latency
recorders switch off.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Protocol

from pagedllm.entrypoints.dashboard.series import LatencyWindow, RateMeter, history_point

logger = logging.getLogger("pagedllm.dashboard")

DEFAULT_INTERVAL_S = 0.25  # 4 updates per second: live, yet a small share of the engine thread
DEFAULT_HISTORY_S = 300.0  # "the last minutes" of the charts


class DashboardSource(Protocol):
    """Where snapshots come from: the serving engine or the simulator.

    A source may also have ``kv_cache_info`` (see source_kv_cache): the pool's KV dtype and bytes,
    added to every snapshot as ``kv_cache`` (or pass them to DashboardHub as ``kv_cache``).
    """

    def now(self) -> float:
        """The source's clock (wall time for a server, simulated time for the simulator)."""

    def is_alive(self) -> bool:
        """False once the source has stopped for good (shutdown, a dead engine)."""

    async def capture(self) -> dict[str, Any]:
        """core.snapshot.take_snapshot(...) plus ``counters``, taken safely between steps; or, for a
        source that is down for now (a replica restarting), ``{"down": reason, ...}``."""


# The engine's pool stats (LLMEngine.kv_cache_info) under the names of the snapshot's "kv_cache".
_KV_CACHE_FIELDS = {
    "kv_cache_dtype": "dtype",
    "kv_cache_storage": "storage",
    "kv_bytes_per_token": "bytes_per_token",
    "kv_block_bytes": "block_bytes",
    "kv_gpu_pool_bytes": "pool_bytes",
    "kv_cpu_pool_bytes": "cpu_pool_bytes",
}


def source_kv_cache(source: Any, info: Any = None) -> dict[str, Any] | None:
    """The KV pool's format and size (``info`` when given), if the source knows them, else None.

    A source may offer ``kv_cache_info`` (a dict, or a method returning one) itself; an engine-backed
    source's engine has it as an attribute. It is fixed at start-up, so reading it off the engine's
    thread is safe and once is enough. Engine stat names (kv_bytes_per_token, ...) become the
    snapshot's (bytes_per_token, ...).
    """
    if info is None:
        info = getattr(source, "kv_cache_info", None)
    if info is None:
        engine = getattr(getattr(source, "async_engine", None), "engine", None)
        info = getattr(engine, "kv_cache_info", None)
    if callable(info):
        info = info()
    if not isinstance(info, dict):
        return None
    return {_KV_CACHE_FIELDS.get(key, key): value for key, value in info.items()}


class _Subscriber:
    def __init__(self) -> None:
        self.payload: bytes | None = None
        self.ready = asyncio.Event()

    def offer(self, payload: bytes) -> None:
        self.payload = payload  # replaces an unsent one: the newest state is all a viewer needs
        self.ready.set()


def sse_event(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class DashboardHub:
    def __init__(self, source: DashboardSource, interval_s: float = DEFAULT_INTERVAL_S,
                 history_s: float = DEFAULT_HISTORY_S, latency_window_s: float = 120.0,
                 kv_cache: dict[str, Any] | None = None) -> None:
        self.source = source
        self.interval_s = interval_s
        self.history: deque[dict[str, Any]] = deque(maxlen=max(1, int(history_s / interval_s)))
        self.ttft = LatencyWindow(latency_window_s)
        self.itl = LatencyWindow(latency_window_s)
        self.rates = RateMeter()
        self._subscribers: set[_Subscriber] = set()
        self._ticker: asyncio.Task | None = None
        self.num_snapshots = 0  # for tests: proves that nobody watching means no snapshot work
        # Shown beside the block map; None leaves the KV dtype and bytes out.
        self.kv_cache = source_kv_cache(source, kv_cache)

    @property
    def active(self) -> bool:
        """True while someone watches: the latency observers record only then."""
        return bool(self._subscribers)

    def record_ttft(self, now: float, seconds: float) -> None:
        if self._subscribers:
            self.ttft.record(now, seconds)

    def record_itl(self, now: float, seconds: float) -> None:
        if self._subscribers:
            self.itl.record(now, seconds)

    async def state(self) -> dict[str, Any]:
        """A full snapshot with its derived series (the /dashboard/state document)."""
        snapshot = await self.source.capture()
        self.num_snapshots += 1
        now = self.source.now()
        if "down" in snapshot:  # a replica that is down (replica_source.py): nothing to draw or chart
            snapshot["time"] = round(now, 3)
            return snapshot
        rates = self.rates.update(now, {name: float(snapshot["counters"].get(name, 0))
                                        for name in ("prompt_tokens", "generation_tokens")})
        point = history_point(now, snapshot, rates, self.ttft.percentiles(now), self.itl.percentiles(now))
        snapshot["time"] = point["t"]
        snapshot["throughput"] = point["tps"]
        snapshot["latency"] = {"ttft": point["ttft"], "itl": point["itl"], "window_s": self.ttft.window_s}
        snapshot["point"] = point
        if self.kv_cache is not None and "kv_cache" not in snapshot:
            snapshot["kv_cache"] = dict(self.kv_cache)
        return snapshot

    async def events(self) -> AsyncIterator[bytes]:
        """The SSE stream of one viewer: the history so far, then a ``state`` event per tick."""
        subscriber = _Subscriber()
        self._subscribers.add(subscriber)
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="pagedllm-dashboard")
        try:
            yield sse_event("history", list(self.history))
            while self.source.is_alive():
                with contextlib.suppress(TimeoutError):
                    # Wake now and then even without news, so a shutdown ends the stream promptly.
                    await asyncio.wait_for(subscriber.ready.wait(), timeout=1.0)
                if subscriber.ready.is_set():
                    subscriber.ready.clear()
                    payload, subscriber.payload = subscriber.payload, None
                    if payload is not None:
                        yield payload
            yield sse_event("end", {"reason": "the server is shutting down or its engine has stopped"})
        finally:
            self._subscribers.discard(subscriber)
            if not self._subscribers and self._ticker is not None:
                self._ticker.cancel()
                self._ticker = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while self._subscribers and self.source.is_alive():
            started = loop.time()
            try:
                state = await self.state()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a failed snapshot must not end the stream (or the server)
                logger.exception("dashboard snapshot failed")
                await asyncio.sleep(1.0)
                continue
            if "point" in state:
                self.history.append(state["point"])
            # Encode once for every viewer; a large pool's map is the bulk of it.
            num_blocks = len(state["map"]["state"]) if "map" in state else 0
            payload = await asyncio.to_thread(sse_event, "state", state) if num_blocks > 20_000 \
                else sse_event("state", state)
            for subscriber in list(self._subscribers):
                subscriber.offer(payload)
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))
