"""Prefix-aware routing over data-parallel replicas: a multi-tenant workload, one run.

Eight tenants each have a system prompt of --prefix-len tokens (seeded random ids); --num-requests
requests (default 64) each send one tenant's system prompt plus --suffix-len tokens of their own,
tenants in a seeded shuffled order, --concurrency in flight, streaming, greedy, --max-tokens each.
Every configuration is a fresh ``pagedllm serve`` on the embedded default model:

- ``single``: one engine in the server's process, --threads threads (the one-machine baseline);
- ``round_robin`` and ``prefix``: ``--data-parallel-size 2`` replicas on a local Ray, one thread
  each, routed by that policy (pagedllm/serving/router.py).

Every configuration gets the same total KV memory, --kv-cache-memory (default 64 MiB, about five
tenants' 512-token prefixes in bfloat16): the single engine all of it, each of the N replicas 1/N of
it (``pagedllm serve --kv-cache-memory`` is per replica, so the script passes total / N). Equal
memory is the fair comparison: replicas do not get more cache than the one engine they replace,
and prefix routing can only win by not duplicating a tenant's prefix on both replicas. The pool
sizes each configuration got (pagedllm:num_gpu_blocks summed over replicas) are reported.

Figures: the prefix-cache hit rate (hit tokens / queried tokens over all replicas, from /metrics),
TTFT p50 and p90 (time to the first streamed token), output tok/s, and the router's decisions.
--repeats rounds, each starting every configuration afresh in a rotated order (the machine is
shared: medians over rounds, and ratios to ``single`` within the run).

    flock /tmp/cpu.lock .venv/bin/python benchmarks/replica_routing.py --json benchmarks/results/replica_routing.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pagedllm.config import parse_bytes  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
VENV_BIN = os.path.join(HERE, "..", ".venv", "bin")
CONFIGS = {
    "single": [],
    "round_robin": ["--data-parallel-size", "2", "--router", "round_robin"],
    "prefix": ["--data-parallel-size", "2", "--router", "prefix"],
}


def num_replicas(name: str) -> int:
    flags = CONFIGS[name]
    return int(flags[flags.index("--data-parallel-size") + 1]) if "--data-parallel-size" in flags else 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_requests(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(100, 40000) for _ in range(args.prefix_len)] for _ in range(args.tenants)]
    tenants = [i % args.tenants for i in range(args.num_requests)]
    rng.shuffle(tenants)
    return [prefixes[t] + [rng.randrange(100, 40000) for _ in range(args.suffix_len)] for t in tenants]


class Server:
    def __init__(self, name: str, args: argparse.Namespace, log_dir: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        threads = args.threads if name == "single" else 1
        # --kv-cache-memory of `pagedllm serve` is per replica: split the total evenly.
        self.kv_cache_memory = args.kv_cache_memory // num_replicas(name)
        command = [os.path.join(VENV_BIN, "pagedllm"), "serve", "--port", str(self.port), "--num-threads",
                   str(threads), "--kv-cache-memory", str(self.kv_cache_memory), "--max-num-seqs", "32"] + CONFIGS[name]
        self.log = open(os.path.join(log_dir, f"serve-{name}-{args.round}.log"), "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while not self._healthy():
            if self.process.poll() is not None:
                raise SystemExit(f"{name}: the server exited ({self.process.returncode}); see {self.log.name}")
            if time.time() > deadline:
                raise SystemExit(f"{name}: the server did not come up; see {self.log.name}")
            time.sleep(1)
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def stream_one(server: Server, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(seconds to the first token, tokens) of one streaming completion."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    tokens = 0
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if event.get("choices") and event["choices"][0].get("text") and first is None:
                first = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return (first if first is not None else time.perf_counter() - start), tokens


def metric_sum(text: str, name: str, labels: str = "") -> float:
    """The sum of pagedllm:NAME's samples (over replicas) whose labels contain ``labels``."""
    samples = re.findall(rf"^pagedllm:{name}(?:{{([^}}]*)}})? (\S+)$", text, re.MULTILINE)
    return sum(float(value) for label_text, value in samples if labels in label_text)


def run(name: str, args: argparse.Namespace, requests: list[list[int]], log_dir: str) -> dict:
    server = Server(name, args, log_dir)
    try:
        stream_one(server, [101, 102, 103], 2)  # warm-up: kernels, thread pools
        before = httpx.get(server.url + "/metrics").text
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda p: stream_one(server, p, args.max_tokens), requests))
        elapsed = time.perf_counter() - start
        after = httpx.get(server.url + "/metrics").text
    finally:
        server.close()
    queried = metric_sum(after, "prefix_cache_queries_total") - metric_sum(before, "prefix_cache_queries_total")
    hits = metric_sum(after, "prefix_cache_hits_total") - metric_sum(before, "prefix_cache_hits_total")
    blocks = metric_sum(after, "num_gpu_blocks")
    decisions = {reason: metric_sum(after, "router_decisions_total", f'reason="{reason}"')
                 for reason in ("prefix_hit", "cold", "overloaded")}
    ttfts = sorted(t for t, _ in results)
    return dict(config=name, round=args.round, replicas=num_replicas(name),
                kv_cache_memory_per_replica=server.kv_cache_memory, kv_blocks_total=blocks,
                hit_rate=hits / queried if queried else 0.0, hit_tokens=hits, queried_tokens=queried,
                ttft_p50=statistics.median(ttfts), ttft_p90=ttfts[int(0.9 * (len(ttfts) - 1))],
                output_tok_s=sum(n for _, n in results) / elapsed, seconds=elapsed, router_decisions=decisions)


SUMMARY_KEYS = ("hit_rate", "ttft_p50", "ttft_p90", "output_tok_s", "kv_blocks_total")


def summarize(rows: list[dict]) -> list[dict]:
    """Per configuration: the median over rounds of every figure, and its ratio to ``single``'s."""
    summary = []
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == name]
        entry = {"config": name, "replicas": mine[0]["replicas"], "rounds": len(mine),
                 "kv_cache_memory_per_replica": mine[0]["kv_cache_memory_per_replica"]}
        entry.update({key: statistics.median(r[key] for r in mine) for key in SUMMARY_KEYS})
        entry["router_decisions"] = {k: statistics.median(r["router_decisions"][k] for r in mine)
                                     for k in mine[0]["router_decisions"]}
        summary.append(entry)
    single = next((e for e in summary if e["config"] == "single"), None)
    for e in summary:
        for key in ("ttft_p50", "output_tok_s"):
            e[f"{key}_vs_single"] = e[key] / single[key] if single and single[key] else None
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("64MiB"),
                        help="TOTAL KV memory of a configuration: the single engine's, split evenly over replicas")
    parser.add_argument("--threads", type=int, default=2, help="the single engine's threads (replicas: 1 each)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds, configurations in a rotated order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default="/tmp/replica_routing_logs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.makedirs(args.log_dir, exist_ok=True)
    requests = make_requests(args)
    rows = []
    for round_index in range(args.repeats):
        args.round = round_index
        shift = round_index % len(args.configs)
        for name in args.configs[shift:] + args.configs[:shift]:
            row = run(name, args, requests, args.log_dir)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    del args.round
    summary = summarize(rows)
    print(f"{args.num_requests} requests, {args.tenants} tenants x {args.prefix_len}-token system prompts, "
          f"{args.concurrency} in flight, {args.kv_cache_memory / (1 << 20):g} MiB of KV in total per configuration; "
          f"medians of {args.repeats} rounds")
    print(f"{'config':12} {'KV blocks':>9} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p90':>9} {'tok/s':>8} "
          f"{'tok/s vs single':>15}  router decisions")
    for r in summary:
        versus = f"{r['output_tok_s_vs_single']:14.2f}x" if r["output_tok_s_vs_single"] else f"{'':15}"
        print(f"{r['config']:12} {r['kv_blocks_total']:9.0f} {r['hit_rate']:9.3f} {r['ttft_p50']:8.2f}s "
              f"{r['ttft_p90']:8.2f}s {r['output_tok_s']:8.1f} {versus}  {r['router_decisions']}")
    by_name = {r["config"]: r for r in summary}
    if "prefix" in by_name and "round_robin" in by_name and by_name["round_robin"]["hit_rate"]:
        ratio = by_name["prefix"]["hit_rate"] / by_name["round_robin"]["hit_rate"]
        print(f"prefix / round_robin hit rate: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), summary=summary, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
