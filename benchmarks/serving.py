"""Online serving benchmark, after vLLM's benchmark_serving: replay a trace against a running server.

Requests come from a synthetic ShareGPT-like or Alpaca-like trace (pagedllm.simulator.traces) or a
ShareGPT JSON file, arrive as a Poisson process at ``--request-rate`` (gamma with ``--burstiness``),
and stream ``/v1/completions`` with ``max_tokens`` = the trace's output length and ``ignore_eos``.
Per request: TTFT, inter-token latencies (per streamed chunk), TPOT, end-to-end latency, output
tokens (from the usage chunk, else the number of chunks). Printed: throughputs, TTFT/TPOT/ITL/E2E
mean/median/p99 and the paper's normalized latency (mean over requests of latency / output length).
Server errors are counted, not fatal.

Prompts are random token ids drawn from the ids the server's tokenizer gives a filler text (always
valid for the model, no shared prefixes); ``--prompt-type text`` sends them detokenized instead.

    # against a running server
    .venv/bin/python benchmarks/serving.py --base-url http://127.0.0.1:8000 --trace sharegpt \\
        --num-prompts 200 --request-rate 4
    # start `pagedllm serve` itself (engine flags after --), sweep rates under a latency bound
    .venv/bin/python benchmarks/serving.py --launch --num-prompts 8 --sweep 1 2 4 \\
        --max-input-len 64 --max-output-len 32 --latency-bound 0.5 -- --device cpu --num-kv-blocks 256

``--compare-chunking`` (with ``--launch``) runs the same benchmark twice in one invocation, on a
server with chunked prefill and on one without, and prints the two side by side. With
``--scenario interference`` the benchmark is the long-prompt interference test: ``--streams``
requests decode while, ``--long-prompt-delay`` seconds in, one ``--long-prompt-len``-token prompt
arrives; the figure is the inter-token latency (p99) of the streams.

    .venv/bin/python benchmarks/serving.py --launch --compare-chunking --scenario interference \\
        -- --device cpu --num-kv-blocks 512
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pagedllm.simulator.traces import TRACE_KINDS, TraceRequest, load_sharegpt, synthetic_trace  # noqa: E402

FILLER = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "Memory is the scarce resource of serving large language models: the key-value cache of every request "
    "grows and shrinks as tokens are generated, so it is stored in fixed-size blocks, like pages of virtual "
    "memory in an operating system. Scientists, engineers, poets and cooks all ask questions; they write "
    "code in Python, Rust, C++ and Go, translate French, German, Spanish, Chinese, and summarize the news "
    "about weather, markets, sports, music, history, mathematics, biology, chemistry and astronomy. 0123456789"
)


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int  # requested (max_tokens)
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


# ----------------------------------------------------------------------------- the requests


def arrival_times(trace: list[TraceRequest], rate: float, burstiness: float, seed: int) -> list[float]:
    """The trace's Poisson arrivals (burstiness 1), or gamma inter-arrival times of mean 1/rate."""
    if rate <= 0 or math.isinf(rate):
        return [0.0] * len(trace)
    if burstiness == 1.0:
        return [r.arrival_time for r in trace]
    rng = random.Random(seed + 2)
    now, times = 0.0, []
    for _ in trace:
        now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        times.append(now)
    return times


def build_trace(args: argparse.Namespace, rate: float) -> list[TraceRequest]:
    if args.trace in TRACE_KINDS:
        trace = synthetic_trace(args.trace, args.num_prompts, rate, args.seed)
    else:
        trace = load_sharegpt(args.trace, args.num_prompts, rate, args.seed)
    for r in trace:
        if args.max_input_len:
            r.prompt_len = min(r.prompt_len, args.max_input_len)
        if args.max_output_len:
            r.output_len = min(r.output_len, args.max_output_len)
    return trace


async def make_prompts(client: httpx.AsyncClient, args: argparse.Namespace, model: str,
                       trace: list[TraceRequest]) -> list[list[int] | str]:
    """One prompt per request, of the trace's prompt length in token ids (text: detokenized)."""
    if args.vocab_size:
        vocab = list(range(100, args.vocab_size))
    else:
        response = await client.post("/tokenize", json={"model": model, "prompt": FILLER, "add_special_tokens": False})
        response.raise_for_status()
        vocab = sorted(set(response.json()["tokens"]))
    rng = random.Random(args.seed + 3)
    prompts: list[list[int] | str] = [[rng.choice(vocab) for _ in range(r.prompt_len)] for r in trace]
    if args.prompt_type == "text":
        texts = []
        for ids in prompts:
            response = await client.post("/detokenize", json={"model": model, "tokens": ids})
            response.raise_for_status()
            texts.append(response.json()["prompt"])
        prompts = texts
    return prompts


async def send_request(client: httpx.AsyncClient, model: str, prompt: list[int] | str, request: TraceRequest,
                       args: argparse.Namespace) -> RequestResult:
    result = RequestResult(request.prompt_len, request.output_len)
    body = {
        "model": model, "prompt": prompt, "max_tokens": request.output_len, "temperature": args.temperature,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    chunks, usage_tokens = 0, None
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])[:200]
                    return result
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
        result.latency = time.perf_counter() - start
        result.output_tokens = usage_tokens if usage_tokens is not None else chunks
        result.success = chunks > 0 or result.output_tokens > 0
        if not result.success:
            result.error = "empty stream"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    return result


async def run_interference(client: httpx.AsyncClient, args: argparse.Namespace, model: str) -> dict:
    """``args.streams`` streams decode; a long prompt arrives while they do. ITL of the streams."""
    streams = [TraceRequest(f"stream-{i}", args.stream_prompt_len, args.stream_output_len) for i in range(args.streams)]
    long = TraceRequest("long", args.long_prompt_len, 4)
    prompts = await make_prompts(client, args, model, streams + [long])
    start = time.perf_counter()

    async def long_request() -> RequestResult:
        await asyncio.sleep(args.long_prompt_delay)
        return await send_request(client, model, prompts[-1], long, args)

    results = await asyncio.gather(*(send_request(client, model, prompts[i], r, args) for i, r in enumerate(streams)),
                                   long_request())
    duration = time.perf_counter() - start
    stream_results, long_result = list(results[:-1]), results[-1]
    summary = summarize(stream_results, duration, float("inf"), 1.0)
    summary["long_prompt"] = {"prompt_len": args.long_prompt_len, "success": long_result.success,
                              "ttft_ms": 1e3 * long_result.ttft, "error": long_result.error}
    summary["max_itl_ms"] = 1e3 * max((x for r in stream_results for x in r.itl), default=float("nan"))
    return summary


async def run_rate(client: httpx.AsyncClient, args: argparse.Namespace, model: str, rate: float) -> dict:
    trace = build_trace(args, rate)
    prompts = await make_prompts(client, args, model, trace)
    times = arrival_times(trace, rate, args.burstiness, args.seed)
    start = time.perf_counter()

    async def delayed(i: int) -> RequestResult:
        await asyncio.sleep(max(0.0, start + times[i] - time.perf_counter()))
        return await send_request(client, model, prompts[i], trace[i], args)

    results = await asyncio.gather(*(delayed(i) for i in range(len(trace))))
    duration = time.perf_counter() - start
    return summarize(results, duration, rate, args.burstiness)


# ----------------------------------------------------------------------------- the figures


def stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean_ms": float("nan"), "median_ms": float("nan"), "p99_ms": float("nan")}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, max(0, math.ceil(0.99 * len(ordered)) - 1))]
    return {"mean_ms": 1e3 * statistics.fmean(values), "median_ms": 1e3 * statistics.median(values),
            "p99_ms": 1e3 * p99}


def summarize(results: list[RequestResult], duration: float, rate: float, burstiness: float) -> dict:
    ok = [r for r in results if r.success]
    output_tokens = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error] = errors.get(r.error, 0) + 1
    normalized = [r.latency / max(1, r.output_tokens) for r in ok]
    return {
        "request_rate": rate if math.isfinite(rate) else "inf",
        "burstiness": burstiness,
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + sum(r.prompt_len for r in ok)) / duration,
        "ttft": stats_ms([r.ttft for r in ok]),
        "tpot": stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl": stats_ms([x for r in ok for x in r.itl]),
        "e2el": stats_ms([r.latency for r in ok]),
        "normalized_latency_s_per_token": statistics.fmean(normalized) if normalized else float("nan"),
        "requests": [asdict(r) | {"tpot": r.tpot} for r in results],
    }


def print_summary(s: dict) -> None:
    print(f"{' Serving Benchmark Result ':=^60}")
    print(f"{'Request rate (req/s):':<40}{s['request_rate']:>20}")
    print(f"{'Burstiness:':<40}{s['burstiness']:>20}")
    print(f"{'Successful requests:':<40}{s['completed']:>20}")
    print(f"{'Failed requests:':<40}{s['failed']:>20}")
    print(f"{'Benchmark duration (s):':<40}{s['duration_s']:>20.2f}")
    print(f"{'Total input tokens:':<40}{s['total_input_tokens']:>20}")
    print(f"{'Total generated tokens:':<40}{s['total_output_tokens']:>20}")
    print(f"{'Request throughput (req/s):':<40}{s['request_throughput']:>20.2f}")
    print(f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:>20.2f}")
    print(f"{'Total token throughput (tok/s):':<40}{s['total_token_throughput']:>20.2f}")
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print(f"{' ' + title + ' ':-^60}")
        for stat in ("mean", "median", "p99"):
            print(f"{f'{stat.capitalize()} {key.upper()} (ms):':<40}{s[key][stat + '_ms']:>20.2f}")
    print(f"{'-' * 60}")
    print(f"{'Normalized latency (s/token):':<40}{s['normalized_latency_s_per_token']:>20.4f}")
    for error, count in s["errors"].items():
        print(f"  error x{count}: {error}")
    print("=" * 60)


# ----------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(engine_flags: list[str], api_key: str | None, timeout: float) -> tuple[subprocess.Popen, str]:
    """`pagedllm serve` on a free loopback port, once /health answers 200."""
    port = free_port()
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--disable-log-requests", "--log-level", "warning", *engine_flags]
    if api_key:
        command += ["--api-key", api_key]
    print("launching:", " ".join(command), flush=True)
    process = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    wait_until_ready(process, url + "/health", timeout, "the server")
    return process, url


def wait_until_ready(process: subprocess.Popen, ready_url: str, timeout: float, what: str) -> None:
    """Poll ``ready_url`` until it answers 200; stop the server and raise if it exits or times out first."""
    deadline = time.time() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode} before it was ready")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return
        if time.time() > deadline:
            stop_server(process)
            raise RuntimeError(f"{what} was not ready within {timeout:.0f}s")
        time.sleep(0.25)


def stop_server(process: subprocess.Popen, timeout: float = 30.0) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# ----------------------------------------------------------------------------- main


async def benchmark(args: argparse.Namespace, base_url: str) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=timeout) as client:
        model = args.model
        if model is None:
            response = await client.get("/v1/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        if args.scenario == "interference":
            print(f"model: {model}  {args.streams} streams of {args.stream_output_len} tokens, a "
                  f"{args.long_prompt_len}-token prompt after {args.long_prompt_delay}s", flush=True)
            summary = await run_interference(client, args, model)
            print_summary(summary)
            print(f"long prompt: TTFT {summary['long_prompt']['ttft_ms']:.0f} ms; streams' max ITL "
                  f"{summary['max_itl_ms']:.0f} ms")
            return {"model": model, **summary}
        print(f"model: {model}  trace: {args.trace}  prompts: {args.num_prompts}", flush=True)
        if args.sweep:
            runs, best = [], None
            for rate in sorted(args.sweep):
                summary = await run_rate(client, args, model, rate)
                print_summary(summary)
                runs.append(summary)
                if summary["failed"] == 0 and summary["normalized_latency_s_per_token"] <= args.latency_bound:
                    best = rate
                elif not args.full_sweep:
                    break  # rates increase: a later one will not do better
            print(f"highest rate with normalized latency <= {args.latency_bound} s/token: "
                  f"{best if best is not None else 'none'} req/s")
            return {"model": model, "latency_bound": args.latency_bound, "max_rate_under_bound": best, "runs": runs}
        summary = await run_rate(client, args, model, args.request_rate)
        print_summary(summary)
        return {"model": model, **summary}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    engine_flags: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, engine_flags = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model name (default: the server's first)")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"))
    parser.add_argument("--trace", default="sharegpt", help="sharegpt, alpaca (synthetic) or a ShareGPT JSON path")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1: Poisson)")
    parser.add_argument("--sweep", type=float, nargs="+", default=None, metavar="RATE", help="rates to try in order")
    parser.add_argument("--latency-bound", type=float, default=0.1, help="normalized-latency bound (s/token)")
    parser.add_argument("--full-sweep", action="store_true", help="keep sweeping past the first rate over the bound")
    parser.add_argument("--max-input-len", type=int, default=None, help="clip the trace's prompt lengths")
    parser.add_argument("--max-output-len", type=int, default=None, help="clip the trace's output lengths")
    parser.add_argument("--prompt-type", choices=["ids", "text"], default="ids")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="draw prompt ids from [100, N) instead of the tokenizer's ids for a filler text")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0, help="per-request read timeout (s)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    parser.add_argument("--launch", action="store_true",
                        help="start `pagedllm serve` on a free loopback port (engine flags after --)")
    parser.add_argument("--launch-timeout", type=float, default=600.0)
    parser.add_argument("--compare-chunking", action="store_true",
                        help="with --launch: run on a server with chunked prefill and on one without, side by side")
    parser.add_argument("--chunked-budget", type=int, default=None, metavar="TOKENS",
                        help="--compare-chunking: the chunked server's step budget (default: the engine's)")
    parser.add_argument("--scenario", choices=["trace", "interference"], default="trace")
    parser.add_argument("--streams", type=int, default=8, help="interference: decoding streams")
    parser.add_argument("--stream-prompt-len", type=int, default=32)
    # 64: a stall that hits every stream once is 8 of 504 gaps (1.6%), which p99 sees.
    parser.add_argument("--stream-output-len", type=int, default=64)
    parser.add_argument("--long-prompt-len", type=int, default=2000)
    parser.add_argument("--long-prompt-delay", type=float, default=3.0, help="seconds before the long prompt")
    args = parser.parse_args(argv)
    if engine_flags and not args.launch:
        parser.error("engine flags after -- need --launch")
    if args.compare_chunking and not args.launch:
        parser.error("--compare-chunking needs --launch")
    return args, engine_flags


def run_launched(args: argparse.Namespace, engine_flags: list[str]) -> tuple[dict, str]:
    process, base_url = launch_server(engine_flags, args.api_key, args.launch_timeout)
    try:
        return asyncio.run(benchmark(args, base_url)), base_url
    finally:
        stop_server(process)
        print(f"server stopped (exit status {process.returncode})")


def _runs(result: dict) -> list[dict]:
    return result["runs"] if "runs" in result else [result]


def compare_chunking(args: argparse.Namespace, engine_flags: list[str]) -> dict:
    """The same benchmark against a chunked-prefill server and an unchunked one, one after the other."""
    results = {}
    for mode in ("chunked", "unchunked"):
        flags = ["--enable-chunked-prefill"] if mode == "chunked" else ["--no-enable-chunked-prefill"]
        if mode == "chunked" and args.chunked_budget is not None:
            flags += ["--max-num-batched-tokens", str(args.chunked_budget)]
        print(f"{f' {mode} ':#^60}", flush=True)
        results[mode], _ = run_launched(args, [*engine_flags, *flags])
    print(f"{' chunked vs unchunked ':=^86}")
    print(f"{'rate':>8}{'TTFT p50 ms':>26}{'ITL p99 ms':>26}{'output tok/s':>26}")
    rows = []
    for chunked, unchunked in zip(_runs(results["chunked"]), _runs(results["unchunked"])):
        row = {
            "request_rate": chunked["request_rate"],
            "ttft_p50_ms": (chunked["ttft"]["median_ms"], unchunked["ttft"]["median_ms"]),
            "itl_p99_ms": (chunked["itl"]["p99_ms"], unchunked["itl"]["p99_ms"]),
            "output_throughput": (chunked["output_throughput"], unchunked["output_throughput"]),
        }
        rows.append(row)
        cells = [f"{a:9.1f} /{b:9.1f} ({a / b:4.2f}x)" for a, b in
                 (row["ttft_p50_ms"], row["itl_p99_ms"], row["output_throughput"])]
        print(f"{row['request_rate']!s:>8}" + "".join(f"{c:>26}" for c in cells))
    print("(chunked / unchunked, ratio)")
    return {"chunked": results["chunked"], "unchunked": results["unchunked"], "comparison": rows}


def main(argv: list[str] | None = None) -> int:
    args, engine_flags = parse_args(sys.argv[1:] if argv is None else argv)
    base_url = args.base_url
    if args.compare_chunking:
        result = compare_chunking(args, engine_flags)
    elif args.launch:
        result, base_url = run_launched(args, engine_flags)
    else:
        result = asyncio.run(benchmark(args, base_url))
    result["args"] = vars(args) | {"engine_flags": engine_flags, "base_url": base_url}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
