"""Prefix-aware routing over data-parallel replicas: a multi-tenant workload, one run.

Eight tenants each have a system prompt of --prefix-len tokens (seeded random ids); --num-requests
requests (default 64) each send one tenant's system prompt plus --suffix-len tokens of their own,
tenants in a seeded shuffled order, --concurrency in flight, streaming, greedy, --max-tokens each.
Every configuration is a fresh ``pagedllm serve`` on the embedded default model:

- ``single``: one engine in the server's process, --threads threads (the one-machine baseline);
- ``round_robin`` and ``prefix``: ``--data-parallel-size 2`` replicas on a local Ray, one thread
  each, routed by that policy (pagedllm/core/router.py).

Each replica's KV pool is --kv-cache-memory (default 64 MiB: about five tenants' prefixes, so a
replica that sees every tenant evicts them in turn, while one that keeps its tenants hits). Figures:
the prefix-cache hit rate (hit tokens / queried tokens over all replicas, from /metrics), TTFT p50
and p90 (time to the first streamed token), output tok/s, and the router's decisions.

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

HERE = os.path.dirname(os.path.abspath(__file__))
VENV_BIN = os.path.join(HERE, "..", ".venv", "bin")
CONFIGS = {
    "single": [],
    "round_robin": ["--data-parallel-size", "2", "--router", "round_robin"],
    "prefix": ["--data-parallel-size", "2", "--router", "prefix"],
}


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
        command = [os.path.join(VENV_BIN, "pagedllm"), "serve", "--port", str(self.port), "--num-threads",
                   str(threads), "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", "32"] + CONFIGS[name]
        self.log = open(os.path.join(log_dir, f"serve-{name}.log"), "w")
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
    decisions = {reason: metric_sum(after, "router_decisions_total", f'reason="{reason}"')
                 for reason in ("prefix_hit", "cold", "overloaded")}
    ttfts = sorted(t for t, _ in results)
    return dict(config=name, hit_rate=hits / queried if queried else 0.0, hit_tokens=hits, queried_tokens=queried,
                ttft_p50=statistics.median(ttfts), ttft_p90=ttfts[int(0.9 * (len(ttfts) - 1))],
                output_tok_s=sum(n for _, n in results) / elapsed, seconds=elapsed, router_decisions=decisions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default="64MiB", help="per replica (and for the single engine)")
    parser.add_argument("--threads", type=int, default=2, help="the single engine's threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default="/tmp/replica_routing_logs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.makedirs(args.log_dir, exist_ok=True)
    requests = make_requests(args)
    rows = []
    for name in args.configs:
        row = run(name, args, requests, args.log_dir)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"{args.num_requests} requests, {args.tenants} tenants x {args.prefix_len}-token system prompts, "
          f"{args.concurrency} in flight, {args.kv_cache_memory} KV per replica")
    print(f"{'config':12} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p90':>9} {'tok/s':>8}  router decisions")
    for r in rows:
        print(f"{r['config']:12} {r['hit_rate']:9.3f} {r['ttft_p50']:8.2f}s {r['ttft_p90']:8.2f}s "
              f"{r['output_tok_s']:8.1f}  {r['router_decisions']}")
    by_name = {r["config"]: r for r in rows}
    if "prefix" in by_name and "round_robin" in by_name and by_name["round_robin"]["hit_rate"]:
        ratio = by_name["prefix"]["hit_rate"] / by_name["round_robin"]["hit_rate"]
        print(f"prefix / round_robin hit rate: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
