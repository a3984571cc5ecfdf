"""The real-size model zoo against llama.cpp, one model at a time, side by side in one run.

For each zoo file (random weights of the real shapes, written by make_gguf_models.py) both engines
run the same GGUF with the same threads:
- llama.cpp's ``llama-bench`` (flash attention on): prompt processing of a 512-token prompt (pp512)
  and single-stream decode of 128 tokens after 128 of context (tg128 at ``-d 128``), one run of
  each per repeat;
- llama.cpp's ``llama-server --parallel 16``: load time (start to /health ready), peak RSS, and
  the aggregate output tok/s of 16 concurrent streams (128-token prompts, 128 new tokens), over the
  whole run and over its decode alone (the run less a batch of the same shape with one new token),
  with a KV cache of 16 x 320 float16 cells;
- pagedllm (``LLM(model=FILE)`` in its own process, benchmarks/quant_runners/run_pagedllm.py): load
  time, peak RSS, single-stream decode (128-token prompt, 128 new tokens, decode time only), pp512
  (the 512-token prompt's pass: arrival to first token), and 16 streams' aggregate, over the same
  KV cells as llama-server's in the same type (``--kv-cache-dtype``, float16 as llama.cpp's default
  f16 cache; pagedllm's "auto" would store float32, its activation type on a CPU).
The engines alternate repeat by repeat (llama-bench ``-r 1``, then ours, with our engine loaded
throughout and llama-server beside it for the streams), and each ratio against llama.cpp is the median
of the repeats' paired ratios: on a shared VM the machine's speed moves between minutes by more than
the margins measured, so two engines measured in windows of their own compare two moments. Where
memory cannot hold both engines at once (gpt-oss-20b), or with ``--sequential``, each engine's repeats
run in a window of their own, and the ratio is of the medians.
The roofline of single-stream decode is read bandwidth (benchmarks/bandwidth.py, measured first
and again after each model, the highest of these: on a shared VM the rate moved between 17.5 and
34.9 GB/s from one run's start to another's, and one measurement taken at a slow moment put a decode
above 100% of its roofline) over the weight bytes one token reads (a MoE's experts counted at
top-k / n_expert). With the engines interleaved, the bandwidth is also probed between repeats, and each
engine's decode is given as a share of its own repeat's roofline (``decode_roofline_share``, the bar's
figure then), so that a fast or slow minute falls on both the decode and its roofline. On the 2-core
Zen 4 VM that did not hold: the probes swung between 29 and 63 GB/s from one repeat to the next, and
two shares came out above 1 (benchmarks/README.md, "Scales beside their quants").
``--contexts 8192 32768`` adds single-stream decode at those context lengths
(llama-bench ``-d``, pagedllm a prompt of that length) for the models whose context allows them,
and at 1024 for the ratio.

    .venv/bin/python benchmarks/make_gguf_models.py --models olmo-2-1b qwen3-4b --types q4_k_m
    .venv/bin/python benchmarks/model_zoo.py --models olmo-2-1b:q4_k_m qwen3-4b:q4_k_m \\
        --json benchmarks/results/model_zoo.json
    .venv/bin/python benchmarks/model_zoo.py --models qwen3-4b:q4_k_m --contexts 8192 32768 --no-streams

Bars (rows that miss are printed as misses): decode >= 1.15x llama.cpp and >= 80% of the roofline;
16 streams >= 2x llama-server and >= 4x our single stream; pp512 >= 1.0x llama.cpp; peak RSS <= file
+ 1.5 GiB; load <= 2x llama.cpp's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

from bandwidth import measure_read_bandwidth  # noqa: E402
from make_gguf_models import SHAPES, model_path  # noqa: E402
from quant_engines import ChildEngine, LlamaServerEngine  # noqa: E402

TOKEN_LOW, TOKEN_HIGH = 100, 30000  # prompt ids: real tokens of every zoo vocabulary
PROMPT, NEW, STREAMS, PP = 128, 128, 16, 512
SLOT_TOKENS = PROMPT + NEW + 64  # llama-server's cells per slot; both engines hold STREAMS x this


@dataclass
class Row:
    model: str
    path: str
    file_gib: float
    roofline_tok_s: float | None = None
    interleaved: bool = True
    bandwidth_runs: list[float] = field(default_factory=list)  # GB/s, probed between repeats (interleaved)
    ours: dict[str, Any] = field(default_factory=dict)
    llamacpp: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def prompts(seed: int, count: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(length)] for _ in range(count)]


def weight_bytes_per_token(path: str) -> int:
    """Bytes one decode step reads: every tensor but the input embedding (unless it is also the LM
    head), a mixture's stacked experts at top-k / n_expert of their size."""
    from pagedllm.models.gguf_loader import read_gguf

    gguf = read_gguf(path)
    arch = gguf.metadata["general.architecture"]
    used = gguf.metadata.get(f"{arch}.expert_used_count")
    experts = gguf.metadata.get(f"{arch}.expert_count")
    tied = "output.weight" not in gguf.tensors
    total = 0.0
    for name, tensor in gguf.tensors.items():
        if name == "token_embd.weight" and not tied:
            continue
        share = used / experts if experts and "_exps" in name else 1.0
        total += tensor.nbytes * share
    return int(total)


def llama_bench(binary: str, path: str, threads: int, repeats: int, args: list[str]) -> list[dict[str, Any]]:
    command = [binary, "-m", path, "-t", str(threads), "-r", str(repeats), "-fa", "1", "-o", "json", *args]
    out = subprocess.run(command, capture_output=True, text=True, timeout=7200)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {out.returncode}:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def bench_rate(entries: list[dict[str, Any]], prompt: int, gen: int, depth: int = 0) -> float | None:
    for e in entries:
        if e["n_prompt"] == prompt and e["n_gen"] == gen and e.get("n_depth", 0) == depth:
            return float(e["avg_ts"])
    return None


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def streams_round(engine: Any, r: int) -> tuple[float, float | None]:
    """Aggregate output tok/s of STREAMS concurrent streams, the same prompts for every engine: (over
    the whole run, its 16 prompts' prefill included; over the decode alone: the run less the same
    prompts' batch with one new token, its first)."""
    reply = engine.batch(prompts(300 + r, STREAMS, PROMPT), NEW)
    # Other prompts of the same lengths: a prefix cache would otherwise make the prefill free.
    prefill = engine.batch(prompts(350 + r, STREAMS, PROMPT), 1)
    decode = None
    if reply["elapsed"] > prefill["elapsed"]:
        decode = (reply["tokens"] - STREAMS) / (reply["elapsed"] - prefill["elapsed"])
    return reply["tokens"] / reply["elapsed"], decode


def ours_round(engine: ChildEngine, r: int) -> tuple[float, float]:
    """(single-stream decode tok/s after a PROMPT-token prompt, pp512 tok/s) of one repeat."""
    reply = engine.single(prompts(100 + r, 1, PROMPT)[0], NEW)
    decode = (reply["tokens"] - 1) / reply["decode_s"]
    reply = engine.single(prompts(200 + r, 1, PP)[0], 1)
    return decode, PP / reply["prefill_s"]


def llamacpp_round(args: argparse.Namespace, path: str) -> tuple[float | None, float | None]:
    """(tg128, pp512) of one ``llama-bench -r 1`` run each. The decode starts at a depth of PROMPT
    tokens, as ours does after its PROMPT-token prompt: from an empty cache it would read less KV."""
    bench = os.path.join(args.peers_dir, "llamacpp", "bin", "llama-bench")
    decode = llama_bench(bench, path, args.threads, 1, ["-p", "0", "-n", str(NEW), "-d", str(PROMPT)])
    prompt = llama_bench(bench, path, args.threads, 1, ["-p", str(PP), "-n", "0"])
    return bench_rate(decode, 0, NEW, PROMPT), bench_rate(prompt, PP, 0)


def ours_process(args: argparse.Namespace, path: str, log_name: str, kv_tokens: int, max_num_seqs: int,
                 max_model_len: int) -> ChildEngine:
    """pagedllm in its own process (quant_runners/run_pagedllm.py) with this run's threads and KV type."""
    return ChildEngine("pagedllm", os.path.join(REPO, ".venv", "bin", "python"), "run_pagedllm.py", path,
                       args.threads, {"kv_tokens": kv_tokens, "max_num_seqs": max_num_seqs,
                                      "llm": {"max_model_len": max_model_len, "kv_cache_dtype": args.kv_cache_dtype}},
                       {}, os.path.join(args.log_dir, log_name))


def open_ours(args: argparse.Namespace, path: str, row: Row) -> ChildEngine:
    engine = ours_process(args, path, f"{row.model}-pagedllm.log", STREAMS * SLOT_TOKENS, STREAMS, PP + NEW)
    row.ours["load_s"] = engine.load_s
    engine.single(prompts(9, 1, PROMPT)[0], 4)  # warm-up
    return engine


def open_server(args: argparse.Namespace, path: str, row: Row) -> LlamaServerEngine:
    server = os.path.join(args.peers_dir, "llamacpp", "bin", "llama-server")
    engine = LlamaServerEngine(server, path, args.threads, STREAMS, SLOT_TOKENS,
                               os.path.join(args.log_dir, f"{row.model}-llama-server.log"), extra_args=["-fa", "on"])
    row.llamacpp["load_s"] = engine.load_s
    return engine


def record(row: Row, figures: dict[str, dict[str, list[float | None]]]) -> None:
    """Each figure's median per engine, its runs, and the median of the repeats' paired ratios (ours
    over llama.cpp's of the same repeat: with the engines interleaved, each ratio is one time window)."""
    for key, runs in figures.items():
        for side, values in (("ours", runs["ours"]), ("llamacpp", runs["llamacpp"])):
            kept = [v for v in values if v is not None]
            getattr(row, side)[key] = median(kept)
            getattr(row, side)[key.replace("_tok_s", "_runs")] = kept
        pairs = [o / c for o, c in zip(runs["ours"], runs["llamacpp"]) if o and c]
        row.ours[key.replace("_tok_s", "_paired_ratio")] = median(pairs)


def memory_fits_both(path: str) -> bool:
    """Whether both engines can stay loaded at once: ours holds its tilings beside the page cache's
    file, llama.cpp its repacked copy; a margin for KV, buffers and the orchestrator."""
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return 3 * os.path.getsize(path) + (4 << 30) <= available


def measure_short(args: argparse.Namespace, path: str, row: Row) -> None:
    """Load, decode, pp512, 16 streams and peak RSS of both engines. With ``row.interleaved`` each
    repeat runs llama.cpp's round, then ours, with our engine loaded throughout (and llama-server beside
    it for the streams); otherwise each engine's repeats run in a window of its own, one engine loaded
    at a time (for files too large to hold twice)."""
    short = {"decode_tok_s": {"ours": [], "llamacpp": []}, "pp512_tok_s": {"ours": [], "llamacpp": []}}
    streams = {"streams16_tok_s": {"ours": [], "llamacpp": []},
               "streams16_decode_tok_s": {"ours": [], "llamacpp": []}}

    bandwidths: list[float] = []

    def probe() -> None:  # the read bandwidth of the moment, for the decode beside it (roofline_shares)
        if row.interleaved:
            bandwidths.append(measure_read_bandwidth(args.threads, repeats=5))

    def llamacpp_rounds() -> None:
        decode, pp = llamacpp_round(args, path)
        short["decode_tok_s"]["llamacpp"].append(decode)
        short["pp512_tok_s"]["llamacpp"].append(pp)

    def add(side: str, rates: tuple[float | None, ...], into: dict[str, dict[str, list[float | None]]]) -> None:
        for key, value in zip(into, rates):
            into[key][side].append(value)

    if not row.interleaved:
        for _ in range(args.repeats):
            llamacpp_rounds()
    ours: ChildEngine | None = open_ours(args, path, row)
    try:
        for r in range(args.repeats):
            probe()
            if row.interleaved:
                llamacpp_rounds()
            add("ours", ours_round(ours, r), short)
        probe()
        if not args.no_streams and not row.interleaved:  # one engine loaded at a time
            for r in range(args.repeats):
                add("ours", streams_round(ours, r), streams)
        memory = ours.memory()
        if not args.no_streams:
            if not row.interleaved:
                ours.close()
                ours = None
            server = open_server(args, path, row)
            try:
                server.batch(prompts(10, 2, PROMPT), 4)  # warm-up
                if ours is not None:
                    ours.batch(prompts(10, 2, PROMPT), 4)
                for r in range(args.repeats):
                    add("llamacpp", streams_round(server, r), streams)
                    if ours is not None:
                        add("ours", streams_round(ours, r), streams)
                row.llamacpp["peak_rss_gib"] = server.memory()["VmHWM"] / 2**30
            finally:
                server.close()
            if ours is not None:
                memory = ours.memory()  # its peak over the streams too
        row.ours["peak_rss_gib"] = memory["VmHWM"] / 2**30
        row.ours["weight_gib"] = (memory.get("weight_bytes") or 0) / 2**30
    finally:
        if ours is not None:
            ours.close()
    record(row, short)
    if bandwidths:
        roofline_shares(row, short["decode_tok_s"], bandwidths, weight_bytes_per_token(path))
    if not args.no_streams:
        record(row, streams)


def roofline_shares(row: Row, decode: dict[str, list[float | None]], bandwidths: list[float],
                    bytes_per_token: int) -> None:
    """Each engine's single-stream decode as a share of the read bandwidth measured beside it: probes r
    and r + 1 run just before and just after repeat r (both engines' rounds), and the repeat's roofline
    is their mean (the machine's rate moves between minutes, so one bandwidth for the whole run
    misstates most repeats). The median share per engine; a share above 1 would mean the probe
    understates what the machine can read."""
    row.bandwidth_runs = [b / 1e9 for b in bandwidths]
    for side in ("llamacpp", "ours"):
        shares = [rate * bytes_per_token * 2 / (bandwidths[r] + bandwidths[r + 1])
                  for r, rate in enumerate(decode[side]) if rate]
        getattr(row, side)["decode_roofline_share_runs"] = shares
        getattr(row, side)["decode_roofline_share"] = median(shares)


def measure_ours_contexts(args: argparse.Namespace, path: str, row: Row, contexts: list[int]) -> None:
    longest = max(contexts)
    engine = ours_process(args, path, f"{row.model}-pagedllm-long.log", longest + 64, 1, longest + 64)
    try:
        for context in contexts:
            reply = engine.single(prompts(400 + context, 1, context)[0], 33)
            row.ours[f"decode_at_{context}_tok_s"] = (reply["tokens"] - 1) / reply["decode_s"]
    finally:
        engine.close()


def measure_llamacpp_contexts(args: argparse.Namespace, path: str, row: Row, contexts: list[int]) -> None:
    bench = os.path.join(args.peers_dir, "llamacpp", "bin", "llama-bench")
    entries = llama_bench(bench, path, args.threads, 1, ["-p", "0", "-n", "32", "-d", ",".join(map(str, contexts))])
    for context in contexts:
        row.llamacpp[f"decode_at_{context}_tok_s"] = bench_rate(entries, 0, 32, context)


def context_length(path: str) -> int:
    from pagedllm.models.gguf_loader import read_gguf

    meta = read_gguf(path).metadata
    return int(meta.get(f"{meta['general.architecture']}.context_length", 0))


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def verdicts(row: Row) -> list[tuple[str, float | None, float, bool]]:
    """(what, value, bar, higher is better) per bar of the issue."""
    o, c = row.ours, row.llamacpp

    def against(key: str) -> float | None:  # the repeats' paired ratios where the engines alternated
        paired = o.get(key.replace("_tok_s", "_paired_ratio"))
        return paired if row.interleaved and paired else ratio(o.get(key), c.get(key))

    out = [("decode / llama.cpp", against("decode_tok_s"), 1.15, True),
           ("decode / roofline", o.get("decode_roofline_share") or ratio(o.get("decode_tok_s"), row.roofline_tok_s),
            0.80, True),
           ("pp512 / llama.cpp", against("pp512_tok_s"), 1.0, True)]
    if "streams16_tok_s" in o:
        out += [("16 streams / llama-server", against("streams16_tok_s"), 2.0, True),
                ("16 streams / our 1 stream", ratio(o.get("streams16_tok_s"), o.get("decode_tok_s")), 4.0, True),
                ("peak RSS - file (GiB)", o["peak_rss_gib"] - row.file_gib if "peak_rss_gib" in o else None, 1.5,
                 False),
                ("load / llama.cpp", ratio(o.get("load_s"), c.get("load_s")), 2.0, False)]
    return out


def rounded(value: Any) -> Any:
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return round(value, 2) if isinstance(value, float) else value


def report(rows: list[Row], bandwidths: list[float]) -> None:
    measured = ", ".join(f"{b / 1e9:.1f}" for b in bandwidths)
    print(f"\nread bandwidth {max(bandwidths) / 1e9:.1f} GB/s (the highest of {measured})")
    for row in rows:
        print(f"\n{row.model} ({row.file_gib:.2f} GiB, roofline {row.roofline_tok_s or 0:.1f} tok/s)")
        print(f"  engines {'interleaved repeat by repeat' if row.interleaved else 'each in its own window'}")
        if row.bandwidth_runs:
            print(f"  read bandwidth between repeats (GB/s): {rounded(row.bandwidth_runs)}")
        for key in sorted(set(row.ours) | set(row.llamacpp)):
            ours, theirs = row.ours.get(key), row.llamacpp.get(key)
            print(f"  {key:32s} pagedllm {rounded(ours)!s:>8}   llama.cpp {rounded(theirs)!s:>8}")
        for what, value, bar, higher in verdicts(row):
            if value is None:  # a figure this run did not take (--no-streams, --skip-short)
                continue
            ok = value >= bar if higher else value <= bar
            print(f"  {'MEETS' if ok else 'MISSES':6s} {what}: {value:.2f} ({'>=' if higher else '<='} {bar})")
        for context in sorted(int(k.split("_")[2]) for k in row.ours if k.startswith("decode_at_")):
            key = f"decode_at_{context}_tok_s"
            against = ratio(row.ours.get(key), row.llamacpp.get(key))
            own = ratio(row.ours.get(key), row.ours.get("decode_at_1024_tok_s"))
            print(f"  decode at {context}: {against or 0:.2f}x llama.cpp's, {own or 0:.2f}x our own at 1024")
        for error in row.errors:
            print(f"  error: {error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", required=True, metavar="SHAPE:TYPE",
                        help=f"shapes {', '.join(SHAPES)}; types q4_0 q4_k_m q8_0 mxfp4")
    parser.add_argument("--models-dir", default="/work/models")
    parser.add_argument("--peers-dir", default="/work/peers")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="float16",
                        help="pagedllm's KV cache type (llama.cpp keeps its default f16 cache)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contexts", nargs="*", type=int, default=[], help="long-context decode (e.g. 8192 32768)")
    parser.add_argument("--no-streams", action="store_true", help="skip the 16-stream, load and memory figures")
    parser.add_argument("--skip-short", action="store_true", help="only the --contexts figures")
    parser.add_argument("--sequential", action="store_true",
                        help="each engine's repeats in a window of its own (the default interleaves them "
                             "where memory holds both engines)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--log-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "pagedllm", "zoo"))
    args = parser.parse_args(argv)
    os.makedirs(args.log_dir, exist_ok=True)
    bandwidths = [measure_read_bandwidth(args.threads)]
    print(f"read bandwidth ({args.threads} threads): {bandwidths[0] / 1e9:.1f} GB/s", flush=True)
    rows = []
    for spec in args.models:
        shape, _, kind = spec.partition(":")
        path = model_path(args.models_dir, shape, kind, pure=False)
        if not os.path.isfile(path):
            raise SystemExit(f"{path} missing: .venv/bin/python benchmarks/make_gguf_models.py --models {shape} "
                             f"--types {kind}")
        row = Row(spec, path, os.path.getsize(path) / 2**30)
        rows.append(row)
        start = time.perf_counter()
        with open(path, "rb") as f:  # into the page cache: neither engine pays the disk read
            while f.read(64 << 20):
                pass
        print(f"\n=== {spec}: {path} ({row.file_gib:.2f} GiB, cached in {time.perf_counter() - start:.0f} s)",
              flush=True)
        row.interleaved = not args.sequential and memory_fits_both(path)
        steps = [] if args.skip_short else [("both engines" if row.interleaved else "each engine", measure_short)]
        contexts = [c for c in args.contexts if c + 64 <= context_length(path)]
        if contexts:
            contexts = [1024, *contexts]
            steps += [("llama.cpp contexts", lambda a, p, r, c=contexts: measure_llamacpp_contexts(a, p, r, c)),
                      ("pagedllm contexts", lambda a, p, r, c=contexts: measure_ours_contexts(a, p, r, c))]
        for name, step in steps:
            try:
                step(args, path, row)
            except Exception as e:  # a failed engine is a row with its error, the run goes on
                row.errors.append(f"{name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            print(f"  {name}: pagedllm {row.ours} llama.cpp {row.llamacpp}", flush=True)
        bandwidths.append(measure_read_bandwidth(args.threads))
        print(f"  read bandwidth ({args.threads} threads): {bandwidths[-1] / 1e9:.1f} GB/s", flush=True)
    bandwidth = max(bandwidths)
    for row in rows:
        row.roofline_tok_s = bandwidth / weight_bytes_per_token(row.path)
    report(rows, bandwidths)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth_bytes_s": bandwidth, "bandwidths_bytes_s": bandwidths, "threads": args.threads,
                       "kv_cache_dtype": args.kv_cache_dtype,
                       "rows": [asdict(r) for r in rows],
                       "command": " ".join(sys.argv)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
