"""Request traces: ShareGPT-like and Alpaca-like synthetic lengths, Poisson arrivals, a ShareGPT loader.

Synthetic lengths are log-normal (long-tailed, as real conversations are), clipped to the
paper's limits, with the scale solved so that the *clipped* mean matches the paper's Table 1:

- ShareGPT-like: prompt mean 161.3 tokens, output mean 338.0, each clipped to [4, 1024]
  (the chatbot limits: 1024-token history, up to 1024 generated; prompt + output <= 2048).
  Log-normal sigma 1.0 for prompts and 0.9 for outputs gives the high variance of Figure 11a.
- Alpaca-like: prompt mean 19.3, output mean 58.5, short and less varied (sigma 0.6 / 0.8),
  clipped to [2, 256] and [1, 512].

Everything is seeded: the same (kind, num_requests, rate, seed) gives the same trace.
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class TraceRequest:
    request_id: str
    prompt_len: int
    output_len: int
    arrival_time: float = 0.0
    n: int = 1  # parallel samples (the paper's parallel-sampling experiments)


@dataclass(frozen=True, slots=True)
class LengthDist:
    mean: float
    sigma: float
    low: int
    high: int


TRACE_KINDS: dict[str, tuple[LengthDist, LengthDist]] = {
    "sharegpt": (LengthDist(161.3, 1.0, 4, 1024), LengthDist(338.0, 0.9, 4, 1024)),
    "alpaca": (LengthDist(19.3, 0.6, 2, 256), LengthDist(58.5, 0.8, 1, 512)),
}


@functools.cache
def _solve_mu(dist: LengthDist) -> float:
    """The log-normal mu whose clipped, rounded samples have the target mean (bisection)."""
    normals = np.random.default_rng(12345).standard_normal(40_000)

    def clipped_mean(mu: float) -> float:
        return float(np.clip(np.rint(np.exp(mu + dist.sigma * normals)), dist.low, dist.high).mean())

    low, high = -5.0, 12.0
    for _ in range(40):
        mid = (low + high) / 2
        if clipped_mean(mid) < dist.mean:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def _sample(dist: LengthDist, rng: random.Random) -> int:
    return min(dist.high, max(dist.low, round(math.exp(_solve_mu(dist) + dist.sigma * rng.gauss(0.0, 1.0)))))


def poisson_arrivals(num: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process of ``rate`` requests/s (rate <= 0 or inf: all at 0)."""
    if rate <= 0 or math.isinf(rate):
        return [0.0] * num
    times, now = [], 0.0
    for _ in range(num):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def synthetic_trace(kind: str, num_requests: int, rate: float, seed: int = 0, n: int = 1,
                    max_total_len: int = 2048) -> list[TraceRequest]:
    """A ShareGPT-like or Alpaca-like trace (see the module docstring)."""
    if kind not in TRACE_KINDS:
        raise ValueError(f"unknown trace kind {kind!r}: use one of {', '.join(TRACE_KINDS)} or a ShareGPT JSON path")
    prompt_dist, output_dist = TRACE_KINDS[kind]
    rng = random.Random(seed)
    lengths = [(_sample(prompt_dist, rng), _sample(output_dist, rng)) for _ in range(num_requests)]
    arrivals = poisson_arrivals(num_requests, rate, random.Random(seed + 1))
    return [
        TraceRequest(f"{kind}-{i}", p, max(1, min(o, max_total_len - p)), t, n)
        for i, ((p, o), t) in enumerate(zip(lengths, arrivals))
    ]


def _approx_token_count(text: str) -> int:
    # ~4 characters per token in English BPE vocabularies; used only without a tokenizer.
    return max(1, round(len(text) / 4))


def load_sharegpt(path: str, num_requests: int, rate: float, seed: int = 0,
                  count_tokens: Callable[[str], int] | None = None, n: int = 1) -> list[TraceRequest]:
    """Requests from a ShareGPT JSON file in the format vLLM's benchmarks read.

    The file is a list of ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
    "value": ...}, ...]}``; the first two turns are the prompt and the reference completion.
    As vLLM's benchmark does: conversations with fewer than two turns are skipped, and pairs with
    prompt or output under 4 tokens, prompt over 1024, or prompt + output over 2048 are dropped;
    then ``num_requests`` are sampled with ``seed``. ``count_tokens`` is a tokenizer's length
    function (e.g. ``lambda s: len(tok.encode(s))``); without one, ~4 characters per token.
    """
    count = count_tokens or _approx_token_count
    with open(path) as f:
        data = json.load(f)
    pairs = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, output = count(turns[0]["value"]), count(turns[1]["value"])
        if prompt < 4 or output < 4 or prompt > 1024 or prompt + output > 2048:
            continue
        pairs.append((prompt, output))
    if not pairs:
        raise ValueError(f"{path}: no usable conversation (need >= 2 turns within the length limits)")
    rng = random.Random(seed)
    if num_requests <= len(pairs):
        chosen = rng.sample(pairs, num_requests)
    else:
        chosen = [rng.choice(pairs) for _ in range(num_requests)]
    arrivals = poisson_arrivals(num_requests, rate, random.Random(seed + 1))
    return [TraceRequest(f"sharegpt-{i}", p, o, t, n) for i, ((p, o), t) in enumerate(zip(chosen, arrivals))]


def make_trace(trace: str, num_requests: int, rate: float, seed: int = 0, n: int = 1) -> list[TraceRequest]:
    """``sharegpt`` / ``alpaca`` (synthetic) or a path to a ShareGPT JSON file."""
    if trace in TRACE_KINDS:
        return synthetic_trace(trace, num_requests, rate, seed, n)
    return load_sharegpt(trace, num_requests, rate, seed, n=n)
