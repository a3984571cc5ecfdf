"""Prometheus metrics of the server, named as vLLM's under the prefix ``pagedllm:``.

Two sources: the engine's ``get_stats()`` (queue lengths, KV usage, token and preemption
counters, the pool's KV dtype and size), read at scrape time and exposed by a custom collector;
and per-request latencies (time to first token, inter-token latency, end-to-end, queue time),
observed by the async engine as outputs arrive. Each app gets its own registry, so several
servers can live in one process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedllm.engine.async_engine import RequestTiming
from pagedllm.sequence import RequestOutput

PREFIX = "pagedllm:"

# Bucket edges as vLLM's.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0]
_REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                            240.0, 480.0, 960.0, 1920.0, 7680.0]
_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]

# Engine stats keys, first match wins (the scheduler's names, with tolerated alternatives).
_STAT_KEYS: dict[str, tuple[str, ...]] = {
    "running": ("num_running", "running", "num_running_seqs", "num_running_groups"),
    "waiting": ("num_waiting", "waiting", "num_waiting_seqs", "num_waiting_groups"),
    "swapped": ("num_swapped", "swapped", "num_swapped_seqs", "num_swapped_groups"),
    "free_gpu_blocks": ("num_free_gpu_blocks", "free_gpu_blocks", "num_free_blocks", "gpu_blocks_free"),
    "used_gpu_blocks": ("num_used_gpu_blocks", "used_gpu_blocks", "num_used_blocks", "gpu_blocks_used"),
    "total_gpu_blocks": ("num_gpu_blocks", "num_total_gpu_blocks", "total_gpu_blocks"),
    "free_cpu_blocks": ("num_free_cpu_blocks", "free_cpu_blocks"),
    "total_cpu_blocks": ("num_cpu_blocks", "num_total_cpu_blocks"),
    "preemptions": ("num_preempted", "num_preemptions", "preemptions"),
    "used_cpu_blocks": ("cpu_blocks_used", "num_used_cpu_blocks"),
    "prefix_queries": ("prefix_cache_queried_tokens", "prefix_cache_queries", "prefix_cache_query_tokens"),
    "prefix_hits": ("prefix_cache_hit_tokens", "prefix_cache_hits", "num_prefix_cache_hits"),
    "prompt_tokens": ("prompt_tokens", "num_prompt_tokens"),
    "generation_tokens": ("generation_tokens", "num_generation_tokens"),
    "kv_bytes_per_token": ("kv_bytes_per_token",),
    "kv_block_bytes": ("kv_block_bytes",),
    "kv_gpu_pool_bytes": ("kv_gpu_pool_bytes",),
}

# Labels of cache_config_info (vLLM's ``vllm:cache_config_info``) and the stats they come from.
_CACHE_INFO_LABELS: dict[str, str] = {
    "block_size": "block_size",
    "cache_dtype": "kv_cache_dtype",
    "cache_storage_dtype": "kv_cache_storage",
    "num_gpu_blocks": "num_gpu_blocks",
    "num_cpu_blocks": "num_cpu_blocks",
    "kv_bytes_per_token": "kv_bytes_per_token",
}


def stat(stats: dict[str, Any], name: str) -> float | None:
    """The engine stat ``name`` (a key of _STAT_KEYS) as a number, or None if the engine lacks it."""
    for key in _STAT_KEYS[name]:
        value = stats.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def used_gpu_blocks(stats: dict[str, Any]) -> float | None:
    used = stat(stats, "used_gpu_blocks")
    if used is not None:
        return used
    total, free = stat(stats, "total_gpu_blocks"), stat(stats, "free_gpu_blocks")
    return None if total is None or free is None else total - free


class _EngineStatsCollector(Collector):
    """Gauges and counters computed from the latest engine stats snapshot at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        stats = self.metrics.stats
        replicas = stats.get("replicas")
        if not isinstance(replicas, dict):  # one engine in this process
            yield from engine_families(stats, ["model_name"], [self.metrics.model_name],
                                       float(self.metrics.requests_in_flight()))
            return
        # Data-parallel replicas (serving/replica_frontend.py): every family once, one sample per replica.
        merged: dict[str, Metric] = {}
        for replica, replica_stats in sorted(replicas.items()):
            for family in engine_families(replica_stats, ["model_name", "replica"],
                                          [self.metrics.model_name, str(replica)],
                                          float(replica_stats.get("requests_in_flight", 0))):
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        yield from merged.values()
        yield from replica_families(stats, self.metrics.model_name)


def engine_families(stats: dict[str, Any], labels: list[str], values: list[str], in_flight: float) -> Iterator[Metric]:
    """The gauges and counters of one engine's stats, each sample labelled ``values``."""

    def gauge(name: str, doc: str, value: float | None) -> Iterable[Metric]:
        if value is None:
            return []
        family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
        family.add_metric(values, value)
        return [family]

    def counter(name: str, doc: str, value: float | None) -> Iterable[Metric]:
        if value is None:
            return []
        family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
        family.add_metric(values, value)
        return [family]

    running = stat(stats, "running")
    if running is None:  # an engine without queue stats: count what the server has in flight
        running = in_flight
    yield from gauge("num_requests_running", "Number of requests in the running batch.", running)
    yield from gauge("num_requests_waiting", "Number of requests waiting to be scheduled.", stat(stats, "waiting"))
    yield from gauge("num_requests_swapped", "Number of requests swapped out to CPU.", stat(stats, "swapped"))
    total = stat(stats, "total_gpu_blocks")
    used = used_gpu_blocks(stats)
    usage = used / total if used is not None and total else (0.0 if total else None)
    yield from gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = 100%).", usage)
    yield from gauge("gpu_cache_usage_perc", "Fraction of device KV cache blocks in use (1 = 100%).", usage)
    cpu_total, cpu_used = stat(stats, "total_cpu_blocks"), stat(stats, "used_cpu_blocks")
    if cpu_used is None and cpu_total is not None and stat(stats, "free_cpu_blocks") is not None:
        cpu_used = cpu_total - (stat(stats, "free_cpu_blocks") or 0.0)
    cpu_usage = cpu_used / cpu_total if cpu_total and cpu_used is not None else (0.0 if cpu_total == 0 else None)
    yield from gauge("cpu_cache_usage_perc", "Fraction of CPU swap blocks in use (1 = 100%).", cpu_usage)
    yield from gauge("num_gpu_blocks", "Device KV cache blocks in the pool.", total)
    yield from gauge("num_cpu_blocks", "CPU swap blocks in the pool.", cpu_total)
    yield from gauge(
        "kv_cache_bytes_per_token",
        "KV cache bytes one token takes: K and V of every layer, quantization scales included "
        "(this rank's share under tensor parallelism).",
        stat(stats, "kv_bytes_per_token"),
    )
    yield from gauge("kv_cache_block_bytes", "Bytes of one KV cache block.", stat(stats, "kv_block_bytes"))
    yield from gauge("kv_cache_pool_bytes", "Bytes of the device KV cache pool.", stat(stats, "kv_gpu_pool_bytes"))
    yield from cache_config_info(stats, labels, values)
    yield from gauge("num_gpu_blocks_used", "Device KV cache blocks held by requests.", used)
    yield from gauge("num_requests_in_flight", "Requests the server is serving now.", in_flight)
    yield from counter("prompt_tokens", "Number of prefill tokens processed.", stat(stats, "prompt_tokens"))
    yield from counter(
        "generation_tokens", "Number of generation tokens processed.", stat(stats, "generation_tokens")
    )
    yield from counter("num_preemptions", "Cumulative number of preemptions.", stat(stats, "preemptions"))
    yield from counter(
        "prefix_cache_queries", "Prefix cache queries, in tokens.", stat(stats, "prefix_queries")
    )
    yield from counter("prefix_cache_hits", "Prefix cache hits, in tokens.", stat(stats, "prefix_hits"))
    yield from spec_decode_counters(stats, labels, values)


def spec_decode_counters(stats: dict[str, Any], labels: list[str], values: list[str]) -> Iterable[Metric]:
    """vLLM's speculative decoding counters; absent when the engine does not speculate."""
    if "spec_decode_num_drafts" not in stats:
        return
    for key, doc in (("num_drafts", "Number of verified drafts."),
                     ("num_draft_tokens", "Number of draft tokens proposed."),
                     ("num_accepted_tokens", "Number of draft tokens accepted.")):
        family = CounterMetricFamily(PREFIX + "spec_decode_" + key, doc, labels=labels)
        family.add_metric(values, float(stats["spec_decode_" + key]))
        yield family
    family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                 "Accepted draft tokens, per position in the draft.", labels=[*labels, "position"])
    for position, count in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"]):
        family.add_metric([*values, str(position)], float(count))
    yield family


def cache_config_info(stats: dict[str, Any], labels: list[str], values: list[str]) -> Iterable[Metric]:
    """``cache_config_info`` = 1 with the pool's settings as labels (vLLM's ``vllm:cache_config_info``).

    Absent for an engine whose stats do not name its KV cache dtype: a label must not lie.
    """
    if not isinstance(stats.get("kv_cache_dtype"), str):
        return []
    info: dict[str, str] = {}
    for label, key in _CACHE_INFO_LABELS.items():
        value = stats.get(key)
        if value is not None:
            info[label] = str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
    family = GaugeMetricFamily(
        PREFIX + "cache_config_info", "Information of the KV cache config (the value is always 1).",
        labels=[*labels, *info],
    )
    family.add_metric([*values, *info.values()], 1.0)
    return [family]


def replica_families(stats: dict[str, Any], model_name: str) -> Iterable[Metric]:
    """Data parallelism: which replicas are live, requests run again elsewhere, the router's decisions."""
    live = GaugeMetricFamily(PREFIX + "replica_live", "1 while the replica serves (in routing), 0 while it is down.",
                             labels=["model_name", "replica"])
    for replica, is_live in sorted(stats.get("replica_live", {}).items()):
        live.add_metric([model_name, str(replica)], 1.0 if is_live else 0.0)
    yield live
    retries = CounterMetricFamily(PREFIX + "replica_request_retries",
                                  "Requests run again on another replica after theirs failed before any output.",
                                  labels=["model_name"])
    retries.add_metric([model_name], float(stats.get("request_retries", 0)))
    yield retries
    router = stats.get("router") or {}
    policy = str(router.get("policy", ""))
    decisions = CounterMetricFamily(PREFIX + "router_decisions",
                                    "Routing decisions by reason (prefix_hit, cold, overloaded, round_robin, ...).",
                                    labels=["model_name", "policy", "reason"])
    for reason, count in sorted(router.get("decisions", {}).items()):
        decisions.add_metric([model_name, policy, str(reason)], float(count))
    yield decisions
    for key, kind, doc in (
        ("requests", CounterMetricFamily, "Requests the router sent to each replica."),
        ("prefix_hit_blocks", CounterMetricFamily, "Prompt blocks routed to a replica that held them (by the "
                                                   "router's record)."),
        ("indexed_blocks", GaugeMetricFamily, "Block hashes the prefix router remembers per replica."),
    ):
        if key not in router:
            continue
        family = kind(PREFIX + "router_" + key, doc, labels=["model_name", "replica"])
        for replica, value in sorted(router[key].items()):
            family.add_metric([model_name, str(replica)], float(value))
        yield family


class ServerMetrics:
    """The server's registry: engine-state metrics plus request latency histograms."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.stats: dict[str, Any] = {}
        self.requests_in_flight = lambda: 0
        labels = ["model_name"]
        reg = self.registry

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS
        )
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time per output token of each request, in seconds.",
            _ITL_BUCKETS,
        )
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Histogram of time spent waiting before the first step, in seconds.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens per request.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens per request.", _TOKEN_BUCKETS
        )
        self.request_success = Counter(
            PREFIX + "request_success", "Count of finished requests by finish reason.",
            ["model_name", "finished_reason"], registry=reg,
        )
        reg.register(_EngineStatsCollector(self))

    def observe_output(self, output: RequestOutput, timing: RequestTiming, now: float, new_tokens: int) -> None:
        """OutputObserver for AsyncLLMEngine: called on every output, before ``timing`` is updated."""
        if new_tokens:
            if timing.first_token_time is None:
                self.time_to_first_token.observe(max(now - timing.arrival_time, 0.0))
            elif timing.last_token_time is not None:
                self.inter_token_latency.observe(max(now - timing.last_token_time, 0.0))
        if not output.finished:
            return
        self.e2e_latency.observe(max(now - timing.arrival_time, 0.0))
        if output.metrics is not None and output.metrics.time_in_queue is not None:
            self.queue_time.observe(max(output.metrics.time_in_queue, 0.0))
        # A pooling request (an embedding) generates nothing and has no completion outputs.
        completions = output.outputs if isinstance(output.outputs, list) else []
        num_generated = sum(len(c.token_ids) for c in completions)
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(num_generated)
        first = timing.first_token_time if timing.first_token_time is not None else now
        if num_generated > 1:
            self.time_per_output_token.observe(max(now - first, 0.0) / (num_generated - 1))
        reason = completions[0].finish_reason if completions else None
        if not isinstance(output.outputs, list) and output.outputs is not None:
            reason = "stop"  # a pooling request ends with its prompt
        if output.error is not None:
            reason = "error"
        self.request_success.labels(self.model_name, reason or "unknown").inc()

    def update_stats(self, stats: dict[str, Any]) -> None:
        if stats:
            self.stats = dict(stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)
