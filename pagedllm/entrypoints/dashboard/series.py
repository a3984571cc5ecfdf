"""Time series of the dashboard: latency percentiles over a window, token rates, the history ring.

Everything here is fed only while someone watches (the hub gates it), so an unwatched server
pays nothing. Times are in the source's clock: wall-clock seconds for a server, simulated
seconds for ``pagedllm dashboard --simulate``.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

PERCENTILES = (50, 90, 99)


class LatencyWindow:
    """Latency samples of the last ``window_s`` seconds and their percentiles.

    Bounded by ``max_samples`` as well: at thousands of tokens per second the window keeps
    the newest samples only, which is what a percentile "over the last minutes" needs.
    """

    def __init__(self, window_s: float = 120.0, max_samples: int = 20_000) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def record(self, now: float, value: float) -> None:
        self.samples.append((now, value))

    def percentiles(self, now: float) -> dict[str, float | None]:
        """p50 / p90 / p99 (nearest rank) of the samples inside the window; None when there are none."""
        horizon = now - self.window_s
        while self.samples and self.samples[0][0] < horizon:
            self.samples.popleft()
        values = sorted(value for _, value in self.samples)
        if not values:
            return {f"p{p}": None for p in PERCENTILES}
        return {f"p{p}": values[max(0, math.ceil(p / 100 * len(values)) - 1)] for p in PERCENTILES}


class RateMeter:
    """Per-second rate of cumulative counters, over the last ``span_s`` seconds of readings."""

    def __init__(self, span_s: float = 2.0) -> None:
        self.span_s = span_s
        self.readings: deque[tuple[float, dict[str, float]]] = deque()

    def update(self, now: float, counters: dict[str, float]) -> dict[str, float]:
        self.readings.append((now, counters))
        # Keep one reading older than the span so the rate always covers at least span_s.
        while len(self.readings) > 2 and self.readings[1][0] <= now - self.span_s:
            self.readings.popleft()
        then, old = self.readings[0]
        elapsed = now - then
        if elapsed <= 0:
            return dict.fromkeys(counters, 0.0)
        return {name: max(0.0, (value - old.get(name, value)) / elapsed) for name, value in counters.items()}


def history_point(now: float, snapshot: dict[str, Any], rates: dict[str, float],
                  ttft: dict[str, float | None], itl: dict[str, float | None]) -> dict[str, Any]:
    """One point of the charts: a few numbers per update, so minutes of history stay small."""
    waste = snapshot["waste"]
    sharing = snapshot["sharing"]
    return {
        "t": round(now, 3),
        "waste": {name: waste[name] for name in ("token", "reserved", "internal", "external", "free")},
        "saved": {"forks": sharing["saved_by_forks"], "prefix": sharing["saved_by_prefix"]},
        "blocks": {name: snapshot["blocks"][name] for name in ("used", "shared", "cached", "swapped")},
        "queues": dict(snapshot["queues"]),
        "preemptions": snapshot["counters"].get("preemptions", 0),
        "tps": {"prompt": round(rates.get("prompt_tokens", 0.0), 2),
                "generation": round(rates.get("generation_tokens", 0.0), 2)},
        "ttft": ttft,
        "itl": itl,
    }
