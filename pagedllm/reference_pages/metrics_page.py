"""reference/metrics.md: every metric ``/metrics`` exports, collected from the server's own registry.

The metrics are not listed here: a ServerMetrics is built as the server builds it, fed engine stats
that name every stat metrics.py reads (one engine, then data-parallel replicas behind a real router),
and its registry collected. A metric whose stat this fake lacks would be missing from the page; the
page's test compares it with a real server's scrape.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.core import Metric

from pagedllm.entrypoints.openai import metrics
from pagedllm.reference_pages.markdown import cell, code, page, table
from pagedllm.serving.router import make_router

MODEL_NAME = "MODEL"
_HEADER = ("name", "type", "labels", "help")
# Sample suffixes of one family (prometheus_client's exposition): the name one queries, by type.
_QUERIED_SUFFIX = {"counter": "_total", "histogram": ""}


def engine_stats() -> dict[str, Any]:
    """One engine's stats with every key metrics.py reads (its _STAT_KEYS, the cache info labels and the
    speculative decoding counters)."""
    stats: dict[str, Any] = {keys[0]: 1 for keys in metrics._STAT_KEYS.values()}
    stats.update({key: 1 for key in metrics._CACHE_INFO_LABELS.values()})
    stats.update(kv_cache_dtype="auto", kv_cache_storage="bfloat16")
    stats.update(spec_decode_num_drafts=1, spec_decode_num_draft_tokens=1, spec_decode_num_accepted_tokens=1,
                 spec_decode_num_accepted_tokens_per_pos=[1])
    return stats


def replica_stats() -> dict[str, Any]:
    """The data-parallel front end's stats (replica_frontend.get_stats' shape) over one replica, with the
    stats of a prefix router that routed one request."""
    router = make_router("prefix", block_size=4)
    prompt = list(range(8))
    router.record(router.choose(prompt, {0: 0}), prompt)
    return {"replicas": {0: {**engine_stats(), "requests_in_flight": 0}}, "replica_live": {0: True},
            "router": router.stats(), "request_retries": 0}


def collect(stats: dict[str, Any]) -> list[Metric]:
    """The families a scrape of a server whose engine reports ``stats`` shows."""
    server_metrics = metrics.ServerMetrics(MODEL_NAME)
    server_metrics.update_stats(stats)
    # A labelled counter shows its labels only once a child exists (after the first finished request).
    server_metrics.request_success.labels(MODEL_NAME, "stop")
    return list(server_metrics.registry.collect())


def queried_name(family: Metric) -> str:
    """The name a query uses: a counter's samples end in ``_total``; a histogram's base name stands for
    its ``_bucket``, ``_sum`` and ``_count``."""
    return family.name + _QUERIED_SUFFIX.get(family.type, "")


def render() -> str:
    single = {family.name: family for family in collect(engine_stats())}
    replicated = {family.name: family for family in collect(replica_stats())}
    body = [
        "Each metric carries the label `model_name` (the served model name); with data-parallel replicas "
        "(`--data-parallel-size`) the engine metrics get a sample per replica, labelled `replica`. Counters are "
        "queried with their `_total` suffix; a histogram is its `_bucket`, `_sum` and `_count` series (and "
        "counters and histograms also export `_created`).",
        "",
        "## Engine and request metrics",
        "",
        *table(_HEADER, [_row(family, replicated.get(family.name)) for family in single.values()]),
        "",
        "## Data-parallel replica metrics",
        "",
        "Only with data-parallel replicas.",
        "",
        *table(_HEADER, [_row(family, None) for name, family in replicated.items() if name not in single]),
    ]
    return page(
        "Metrics",
        "Generated from the Prometheus registry of `pagedllm/entrypoints/openai/metrics.py` (ServerMetrics), "
        "collected as `GET /metrics` would be, with the `pagedllm:` prefix.",
        body,
    )


def labels(family: Metric) -> list[str]:
    """The label names of a family's samples, in order (a histogram's ``le`` is the bucket's, not the metric's)."""
    found: dict[str, None] = {}
    for sample in family.samples:
        found.update(dict.fromkeys(name for name in sample.labels if name != "le"))
    return list(found)


def _row(family: Metric, replicated: Metric | None) -> list[str]:
    names = [code(label) for label in labels(family)]
    if replicated is not None:
        names += [f"{code(label)} (replicas)" for label in labels(replicated) if label not in labels(family)]
    return [code(queried_name(family)), family.type, ", ".join(names), cell(family.documentation)]
