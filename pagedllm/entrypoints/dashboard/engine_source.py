"""The serving engine as a dashboard source: snapshots taken on the engine's own thread.

LLMEngine is not thread-safe and AsyncLLMEngine runs every call into it on one worker thread,
in submission order. Submitting the snapshot there puts it *between* two steps: the block
tables, ref counts and queues it reads are never half-updated, and the engine is never
touched from another thread. The snapshot only reads; its lists are fresh copies, so encoding
them later (on the event loop) cannot race with the next step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from pagedllm.engine.async_engine import AsyncLLMEngine, RequestTiming
from pagedllm.engine.snapshot import capture_between_steps
from pagedllm.entrypoints.dashboard.hub import DashboardHub
from pagedllm.sequence import RequestOutput


class EngineSource:
    def __init__(self, async_engine: AsyncLLMEngine) -> None:
        self.async_engine = async_engine

    def now(self) -> float:
        return time.time()

    def is_alive(self) -> bool:
        return self.async_engine.is_healthy

    async def capture(self) -> dict[str, Any]:
        return await capture_between_steps(self.async_engine)


def observe_latencies(async_engine: Any, hubs_of: Callable[[RequestOutput], Iterable[DashboardHub]]) -> None:
    """Chain TTFT / ITL recording into ``hubs_of(output)`` after the engine's existing output observer.

    Same definitions as the Prometheus histograms (entrypoints/openai/metrics.py); a hub drops
    the samples unless someone is watching it.
    """
    previous = async_engine.output_observer

    def observe(output: RequestOutput, timing: RequestTiming, now: float, new_tokens: int) -> None:
        if previous is not None:
            previous(output, timing, now, new_tokens)
        if not new_tokens:
            return
        for hub in hubs_of(output):
            if not hub.active:
                continue
            if timing.first_token_time is None:
                hub.record_ttft(now, max(now - timing.arrival_time, 0.0))
            elif timing.last_token_time is not None:
                hub.record_itl(now, max(now - timing.last_token_time, 0.0))

    async_engine.output_observer = observe
