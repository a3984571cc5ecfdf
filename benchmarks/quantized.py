"""Quantized models side by side in one run: pagedllm against llama.cpp (issue 11).

Models (``--models``; a name below or a path to a .gguf):
- ``default``: the embedded SmolLM2-135M-Instruct, Q4_1;
- ``1b-q4_0``, ``1b-q4_k_m``: random Llama-3.2-1B-shaped GGUFs, ``8b-q4_k_m``: random Llama-3-8B-shaped
  (written by benchmarks/make_gguf_models.py into --models-dir, default /work/models).
Engines (``--engines``), each in its own process so that peak RSS is its own:
- ``pagedllm``: ``LLM(model=FILE.gguf)`` (quant_runners/run_pagedllm.py), once per ``--pagedllm-variant``
  (``--pagedllm-variant int8_activations=false`` adds a pagedllm row with that ``LLM(...)`` keyword;
  upper-case keys set the environment instead: ``PAGEDLLM_QUANT_KERNEL=torch``; comma-separate several
  KEY=VAL in one variant);
- ``llamacpp``: llama-cpp-python's ``Llama`` for one stream (quant_runners/run_llamacpp.py); it also
  serves the many-streams figures through the batched ``llama_decode`` API when ``llamacpp-server``
  is not run (``--llamacpp-streams batched`` forces that);
- ``llamacpp-server``: llama.cpp's own ``llama-server --parallel 16 --cont-batching`` (built by
  ``benchmarks/setup_peers.sh DIR llamacpp-server``), for the many-streams figures over HTTP;
- ``vllm``: vLLM-CPU on the Hugging Face float32 folder of the same model, where one exists
  (``--hf-dir MODEL=DIR``; ``default`` finds the folder benchmarks/peers.py built) and DIR/vllm is
  installed; skipped otherwise (vLLM does not read GGUF on CPU).

Per engine and model: load time (the model only: libraries are imported before the clock starts; the
file is read once beforehand so every engine finds it in the page cache), peak RSS (VmHWM of the
engine's process at the end; the anonymous / file-backed split of its RSS beside it, as llama.cpp mmaps
the GGUF), the bytes of the tensors pagedllm's model holds, single-stream decode tok/s (``--prompt-len``
random token ids, ``--max-tokens`` new ones, EOS ignored, decode time only: first to last new token)
next to the memory-bandwidth roofline (benchmarks/bandwidth.py), and aggregate output tok/s for each of
``--streams`` concurrent streams (all submitted at once, wall time including prefill). Engines are
loaded side by side, warmed up, then measured ``--repeats`` times in a rotating order (the machine is
shared: compare ratios within one run); medians are reported. Prompts are new each repeat and level (no
prefix-cache hits), the same for every engine.

    .venv/bin/python benchmarks/quantized.py --models default 1b-q4_0 --engines pagedllm llamacpp \\
        --streams --repeats 1                                                   # a quick look
    .venv/bin/python benchmarks/quantized.py --models default 1b-q4_0 1b-q4_k_m --repeats 3 \\
        --json benchmarks/results/quantized.json
    .venv/bin/python benchmarks/quantized.py --models 1b-q4_0 --engines pagedllm llamacpp --streams 16 \\
        --pagedllm-variant int8_activations=false                               # float activations too

Bars printed at the end (issue 11): 1B Q4_0 single stream >= 1.0x llama.cpp, 16 streams >= 2x
llama.cpp server's aggregate, peak RSS <= 1.3x llama.cpp's; 8B Q4_K_M single stream >= 0.8x;
default model: pagedllm's resident weight bytes <= 1.5x the GGUF file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

from quant_engines import ChildEngine, LlamaServerEngine  # noqa: E402

MODEL_FILES = {"1b-q4_0": ("1b", "q4_0"), "1b-q4_k_m": ("1b", "q4_k_m"), "8b-q4_k_m": ("8b", "q4_k_m")}
ENGINES = ("pagedllm", "llamacpp", "llamacpp-server", "vllm")
TOKEN_LOW, TOKEN_HIGH = 100, 49152  # prompt ids: real tokens of the (padded) SmolLM2 vocabulary


@dataclass
class Result:
    engine: str
    model: str
    load_s: float | None = None
    memory: dict[str, Any] = field(default_factory=dict)  # at the end (every phase's peak)
    memory_single: dict[str, Any] = field(default_factory=dict)  # after the single-stream phase
    single_tok_s: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    streams_tok_s: dict[int, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    def median_single(self) -> float | None:
        return statistics.median(self.single_tok_s) if self.single_tok_s else None

    def median_streams(self, n: int) -> float | None:
        values = self.streams_tok_s.get(n)
        return statistics.median(values) if values else None


# ------------------------------------------------------------------------------------------ setup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["default", "1b-q4_0"],
                        help=f"default, {', '.join(MODEL_FILES)}, or .gguf paths")
    parser.add_argument("--models-dir", default="/work/models")
    parser.add_argument("--engines", nargs="+", default=["pagedllm", "llamacpp", "llamacpp-server"], choices=ENGINES)
    parser.add_argument("--streams", nargs="*", type=int, default=[4, 16, 64],
                        help="concurrent-stream levels (none: single stream only)")
    parser.add_argument("--no-single", action="store_true", help="skip the single-stream measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peers-dir", default="/work/peers", help="made by benchmarks/setup_peers.sh")
    parser.add_argument("--llamacpp-python", default=None, help="default: PEERS_DIR/llamacpp/bin/python")
    parser.add_argument("--llama-server", default=None, help="default: PEERS_DIR/llamacpp/bin/llama-server")
    parser.add_argument("--server-parallel", type=int, default=16, help="llama-server --parallel")
    parser.add_argument("--llamacpp-streams", choices=("auto", "server", "batched"), default="auto",
                        help="who serves llama.cpp's many-streams figures (auto: the server when it runs)")
    parser.add_argument("--pagedllm-variant", action="append", default=[], metavar="KEY=VAL[,KEY=VAL]",
                        help="an extra pagedllm row with these LLM(...) keywords (upper-case keys: "
                             "environment variables) (repeatable)")
    parser.add_argument("--pagedllm-option", action="append", default=[], metavar="KEY=VALUE",
                        help="LLM(...) keyword for every pagedllm variant; VALUE parsed as JSON if it can be")
    parser.add_argument("--hf-dir", action="append", default=[], metavar="MODEL=DIR",
                        help="Hugging Face float folder of MODEL, for vLLM")
    parser.add_argument("--json", default=None, help="write every figure here (e.g. benchmarks/results/quantized.json)")
    parser.add_argument("--log-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "pagedllm", "quantized"))
    return parser.parse_args(argv)


def resolve_model(name: str, models_dir: str) -> str:
    if name == "default":
        from pagedllm.models.loader import default_model_path

        return default_model_path()
    if name in MODEL_FILES:
        from make_gguf_models import model_path

        shape, kind = MODEL_FILES[name]
        path = model_path(models_dir, shape, kind, pure=False)
        if not os.path.isfile(path):
            raise SystemExit(f"{path} missing: .venv/bin/python benchmarks/make_gguf_models.py --models {shape} "
                             f"--types {kind}")
        return path
    if not os.path.isfile(name):
        raise SystemExit(f"model {name!r}: neither a known name ({', '.join(['default', *MODEL_FILES])}) nor a file")
    return name


def parse_variant(spec: str) -> tuple[dict[str, str], dict[str, Any]]:
    """``KEY=VAL[,KEY=VAL]`` -> (environment: the upper-case keys, LLM keywords: the others)."""
    env: dict[str, str] = {}
    pairs = []
    for pair in filter(None, spec.split(",")):
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--pagedllm-variant {spec!r}: expected KEY=VAL[,KEY=VAL]")
        if key.strip().isupper():
            env[key.strip()] = value
        else:
            pairs.append(pair)
    return env, parse_options(pairs)


def parse_options(specs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` -> {KEY: VALUE parsed as JSON where it can be}."""
    options: dict[str, Any] = {}
    for spec in specs:
        key, _, value = spec.partition("=")
        try:
            options[key.strip()] = json.loads(value)
        except ValueError:
            options[key.strip()] = value
    return options


def warm_page_cache(path: str) -> float:
    """Read the file once so that no engine pays the disk read the one before it saved the next."""
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    return time.perf_counter() - start


# Seeds of the warm-up prompts, apart from the measured ones (1000 * repeat + small numbers): a
# warm-up prompt equal to a measured one would make that one a prefix-cache hit.
WARM_UP_SEEDS = (10**9, 10**9 + 1)


def prompts_for(seed: int, count: int, length: int) -> list[list[int]]:
    assert seed >= 0, "random.Random(-s) gives random.Random(s)'s numbers"
    rng = random.Random(seed)
    return [[rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(length)] for _ in range(count)]


# ------------------------------------------------------------------------------------------ engines


@dataclass
class Slot:
    """One engine row for one model: how to start it and what it measures."""
    name: str
    start: Any  # () -> engine
    single: bool
    streams: bool
    engine: Any = None


def plan_engines(args: argparse.Namespace, model_name: str, path: str,
                 kv_tokens: int) -> tuple[list[Slot], list[Result]]:
    slots: list[Slot] = []
    skipped: list[Result] = []
    os.makedirs(args.log_dir, exist_ok=True)
    tag = os.path.basename(path).removesuffix(".gguf")
    max_seqs = max([1, *args.streams])

    def log(engine: str) -> str:
        return os.path.join(args.log_dir, f"{tag}-{engine.replace(' ', '_').replace('=', '-')}.log")

    if "pagedllm" in args.engines:
        pagedllm_python = os.path.join(REPO, ".venv", "bin", "python")
        for variant in [""] + args.pagedllm_variant:
            env, keywords = parse_variant(variant)
            options = {"kv_tokens": kv_tokens, "max_num_seqs": max(16, max_seqs),
                       "llm": {**parse_options(args.pagedllm_option), **keywords}}
            name = "pagedllm" + (f"[{variant}]" if variant else "")
            slots.append(Slot(name, lambda name=name, env=env, options=options: ChildEngine(
                name, pagedllm_python, "run_pagedllm.py", path, args.threads, options, env, log(name)),
                True, True))
    peers = os.path.expanduser(args.peers_dir)
    server_bin = args.llama_server or os.path.join(peers, "llamacpp", "bin", "llama-server")
    server_runs = "llamacpp-server" in args.engines and os.path.isfile(server_bin)
    if "llamacpp-server" in args.engines and not server_runs:
        skipped.append(Result("llama.cpp server", model_name, error=f"skipped: {server_bin} not built "
                              "(bash benchmarks/setup_peers.sh DIR llamacpp-server)"))
    if "llamacpp" in args.engines:
        llama_python = args.llamacpp_python or os.path.join(peers, "llamacpp", "bin", "python")
        batched = args.llamacpp_streams == "batched" or (args.llamacpp_streams == "auto" and not server_runs)
        if not os.path.isfile(llama_python):
            skipped.append(Result("llama.cpp", model_name, error=f"skipped: {llama_python} missing "
                                  "(bash benchmarks/setup_peers.sh DIR llamacpp)"))
        else:
            llama_options = {"n_ctx": (args.prompt_len + args.max_tokens + 255) // 256 * 256,
                             "kv_tokens": kv_tokens, "max_seqs": max_seqs}
            name = "llama.cpp" + (" (batched API)" if batched and args.streams else "")
            slots.append(Slot(name, lambda name=name: ChildEngine(
                name, llama_python, "run_llamacpp.py", path, args.threads, llama_options, {}, log("llamacpp")),
                True, batched))
    if server_runs and args.llamacpp_streams != "batched":
        slot_tokens = (args.prompt_len + args.max_tokens + 63) // 64 * 64
        slots.append(Slot("llama.cpp server", lambda: LlamaServerEngine(
            server_bin, path, args.threads, args.server_parallel, slot_tokens, log("llama-server")), True, True))
    if "vllm" in args.engines:
        slot = plan_vllm(args, model_name, kv_tokens, log("vllm"))
        if isinstance(slot, Slot):
            slots.append(slot)
        else:
            skipped.append(Result("vllm", model_name, error=slot))
    return slots, skipped


def plan_vllm(args: argparse.Namespace, model_name: str, kv_tokens: int, log_path: str) -> Slot | str:
    python = os.path.join(os.path.expanduser(args.peers_dir), "vllm", "bin", "python")
    if not os.path.isfile(python):
        return f"skipped: {python} missing (bash benchmarks/setup_peers.sh DIR vllm)"
    folders = dict(spec.split("=", 1) for spec in args.hf_dir)
    folder = folders.get(model_name)
    if folder is None and model_name == "default":
        folder = os.path.join(os.path.expanduser("~"), ".cache", "pagedllm", "peers", "default", "hf")
    if not folder or not os.path.isfile(os.path.join(folder, "config.json")):
        return f"skipped: no Hugging Face folder for {model_name} (--hf-dir {model_name}=DIR)"
    options = {"kv_tokens": kv_tokens, "max_num_seqs": max([16, *args.streams])}
    return Slot("vllm (float32)", lambda: ChildEngine("vllm (float32)", python, "run_vllm.py", folder, args.threads,
                                                       options, {}, log_path), True, True)


# ------------------------------------------------------------------------------------------ measuring


def run_model(args: argparse.Namespace, model_name: str, path: str) -> list[Result]:
    kv_tokens = max([1, *args.streams]) * (args.prompt_len + args.max_tokens)
    slots, results = plan_engines(args, model_name, path, kv_tokens)
    print(f"\n=== {model_name}: {path} ({os.path.getsize(path) / 2**30:.2f} GiB); read into the page cache in "
          f"{warm_page_cache(path):.1f} s", flush=True)
    live: list[tuple[Slot, Result]] = []
    try:
        for slot in slots:
            result = Result(slot.name, model_name)
            results.append(result)
            print(f"loading {slot.name} ...", flush=True)
            try:
                slot.engine = slot.start()
            except Exception as e:
                result.error = f"load failed: {e}"
                print(result.error.splitlines()[0])
                continue
            result.load_s = slot.engine.load_s
            print(f"  {slot.name} loaded in {result.load_s:.1f} s", flush=True)
            try:  # warm-up: a short stream (the batch warm-up comes after the single-stream figures)
                slot.engine.single(prompts_for(WARM_UP_SEEDS[0], 1, args.prompt_len)[0], 4)
            except Exception as e:
                result.error = f"warm-up failed: {e}"
                print(result.error.splitlines()[0])
                continue
            live.append((slot, result))
        measure(args, live)
        for slot, result in live:
            try:
                result.memory = slot.engine.memory()
            except Exception as e:
                result.notes.append(f"memory: {e}")
    finally:
        for slot in slots:
            if slot.engine is not None:
                slot.engine.close()
    return results


def rotated(items: list, shift: int) -> list:
    shift %= max(1, len(items))
    return items[shift:] + items[:shift]


def measure(args: argparse.Namespace, live: list[tuple[Slot, Result]]) -> None:
    """Every single-stream repeat first, each engine's memory after them (its single-stream peak,
    what llama.cpp's one-stream ``Llama`` is compared with), then the many-streams repeats."""
    for repeat in range(args.repeats if not args.no_single else 0):
        if not args.no_single:
            prompt = prompts_for(1000 * repeat + 1, 1, args.prompt_len)[0]
            for slot, result in rotated([x for x in live if x[0].single], repeat):
                if result.error:
                    continue
                try:
                    reply = slot.engine.single(prompt, args.max_tokens)
                except Exception as e:
                    result.error = f"single stream failed: {e}"
                    continue
                rate = (reply["tokens"] - 1) / reply["decode_s"]
                result.single_tok_s.append(rate)
                result.prefill_s.append(reply["prefill_s"])
                print(f"[{repeat}] {slot.name:28s} 1 stream  {rate:7.2f} tok/s decode "
                      f"(prefill {reply['prefill_s']:.2f} s)", flush=True)
    for slot, result in live:
        try:
            result.memory_single = slot.engine.memory()
            if slot.streams and args.streams and not result.error:
                slot.engine.batch(prompts_for(WARM_UP_SEEDS[1], 2, args.prompt_len), 4)  # warm-up of the batched path
        except Exception as e:
            result.notes.append(f"after the single streams: {e}")
    for repeat in range(args.repeats):
        for n in args.streams:
            prompts = prompts_for(1000 * repeat + n + 2, n, args.prompt_len)
            for slot, result in rotated([x for x in live if x[0].streams], repeat):
                if result.error:
                    continue
                try:
                    reply = slot.engine.batch(prompts, args.max_tokens)
                except Exception as e:
                    result.error = f"{n} streams failed: {e}"
                    continue
                if reply["tokens"] != n * args.max_tokens:
                    result.notes.append(f"{n} streams: {reply['tokens']} tokens, not {n * args.max_tokens}")
                rate = reply["tokens"] / reply["elapsed"]
                result.streams_tok_s.setdefault(n, []).append(rate)
                print(f"[{repeat}] {slot.name:28s} {n:2d} streams {rate:7.2f} tok/s aggregate "
                      f"({reply['elapsed']:.1f} s)", flush=True)


# ------------------------------------------------------------------------------------------ report


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def report(args: argparse.Namespace, results: list[Result], paths: dict[str, str], bandwidth: float) -> list[dict]:
    from bandwidth import weight_bytes_per_token

    rows = []
    streams_cols = "".join(f" {f'{n} streams':>10s} |" for n in args.streams)
    print(f"\nread bandwidth {bandwidth / 1e9:.1f} GB/s ({args.threads} threads); single stream: {args.prompt_len} "
          f"prompt + {args.max_tokens} new tokens, decode only; streams: aggregate output tok/s\n")
    print(f"| model | engine | load s | peak RSS GiB: 1 stream / all | anon / file GiB | weights GiB | "
          f"1 stream tok/s (roofline) | 1 stream prefill s |{streams_cols}")
    print("|---|---|---:|---:|---:|---:|---|---:|" + "---:|" * len(args.streams))
    for r in results:
        per_token = weight_bytes_per_token(paths[r.model])
        roofline = bandwidth / per_token
        single = r.median_single()
        peak = r.memory.get("VmHWM")
        single_text = f"{fmt(single, '.2f')} ({roofline:.1f})" if single else "-"
        prefill = statistics.median(r.prefill_s) if r.prefill_s else None
        cells = "".join(f" {fmt(r.median_streams(n)):>10s} |" for n in args.streams)
        name = r.engine + (f" — {r.error.splitlines()[0][:90]}" if r.error else "")
        weights = r.memory.get("weight_bytes")  # tensors the engine holds (pagedllm reports it)
        anon, file = r.memory.get("RssAnon"), r.memory.get("RssFile")  # at the end; file = mmapped pages
        split = f"{anon / 2**30:.2f} / {file / 2**30:.2f}" if anon is not None and file is not None else "-"
        peak_single = r.memory_single.get("VmHWM")
        peaks = f"{fmt(peak_single and peak_single / 2**30, '.2f')} / {fmt(peak and peak / 2**30, '.2f')}"
        print(f"| {r.model} | {name} | {fmt(r.load_s)} | {peaks} | {split} | "
              f"{fmt(weights and weights / 2**30, '.2f')} | {single_text} | {fmt(prefill, '.2f')} |{cells}")
        rows.append({"model": r.model, "path": paths[r.model], "file_bytes": os.path.getsize(paths[r.model]),
                     "engine": r.engine, "load_s": r.load_s, "memory": r.memory, "memory_single": r.memory_single,
                     "single_decode_tok_s": r.single_tok_s, "single_decode_tok_s_median": single,
                     "single_prefill_s": r.prefill_s, "single_prefill_s_median": prefill,
                     "weight_bytes_per_token": per_token,
                     "roofline_tok_s": roofline, "streams_tok_s": {str(k): v for k, v in r.streams_tok_s.items()},
                     "streams_tok_s_median": {str(n): r.median_streams(n) for n in args.streams},
                     "notes": r.notes, "error": r.error})
    return rows


def ratio_line(out: list[dict], model: str, engine: str, what: str, ours: float | None, theirs: float | None,
               bar: str | None, higher: bool = True) -> None:
    """Print and record ours / theirs, with PASS / FAIL against the bar when there is one."""
    if not ours or not theirs:
        return
    ratio = ours / theirs
    verdict = ""
    if bar:
        passed = ratio >= float(bar) if higher else ratio <= float(bar)
        verdict = f"  {'PASS' if passed else 'FAIL'} (bar {'>=' if higher else '<='} {bar}x)"
    print(f"  {model:10s} {engine:24s} {what:40s} {ratio:6.2f}x{verdict}")
    out.append({"model": model, "engine": engine, "what": what, "ratio": ratio, "bar": bar,
                "higher_is_better": higher})


def ratios(args: argparse.Namespace, results: list[Result], paths: dict[str, str]) -> list[dict]:
    """pagedllm (every variant) against llama.cpp, with the issue's bars where one applies."""
    out: list[dict] = []
    by = {(r.model, r.engine): r for r in results}
    print("\nratios vs llama.cpp (bars of issue 11 where one applies):")
    for r in results:
        if not r.engine.startswith("pagedllm") or r.error:
            continue
        model = r.model
        llama = by.get((model, "llama.cpp")) or by.get((model, "llama.cpp (batched API)"))
        server = by.get((model, "llama.cpp server"))
        streams_peer = server if server and not server.error else llama
        is_1b_q4_0, is_8b = model == "1b-q4_0", model == "8b-q4_k_m"
        if llama:
            ratio_line(out, model, r.engine, "single-stream decode", r.median_single(), llama.median_single(),
                       "1.0" if is_1b_q4_0 else "0.8" if is_8b else None)
        if streams_peer:
            for n in args.streams:
                ratio_line(out, model, r.engine, f"{n} streams vs {streams_peer.engine}", r.median_streams(n),
                           streams_peer.median_streams(n), "2.0" if is_1b_q4_0 and n == 16 else None)
        # Like with like: the one-stream peak against Llama's (one stream), the whole run's against the
        # server's (which served the many streams).
        if llama and r.memory_single and llama.memory_single:
            ratio_line(out, model, r.engine, f"single-stream peak RSS vs {llama.engine}", r.memory_single.get("VmHWM"),
                       llama.memory_single.get("VmHWM"), "1.3" if is_1b_q4_0 else None, higher=False)
        if server:
            ratio_line(out, model, r.engine, f"peak RSS vs {server.engine}", r.memory.get("VmHWM"),
                       server.memory.get("VmHWM"), "1.3" if is_1b_q4_0 else None, higher=False)
        ratio_line(out, model, r.engine, "weight bytes vs GGUF file size", r.memory.get("weight_bytes"),
                   os.path.getsize(paths[model]), "1.5" if model == "default" else None, higher=False)
    return out


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    from bandwidth import measure_read_bandwidth

    args = parse_args(argv)
    paths = {name: resolve_model(name, args.models_dir) for name in args.models}
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > 0.5 * cores:
        print(f"warning: load average {load:.1f} on {cores} cores: the CPU is shared, figures are noisy")
    bandwidth = measure_read_bandwidth(args.threads)
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s ({args.threads} threads)")
    results: list[Result] = []
    for name, path in paths.items():
        results += run_model(args, name, path)
    rows = report(args, results, paths, bandwidth)
    ratio_rows = ratios(args, results, paths)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "read_bandwidth_bytes_s": bandwidth, "load_average_at_start": load,
                       "rows": rows, "ratios": ratio_rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
