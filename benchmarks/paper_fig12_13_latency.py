"""Figures 12 and 13: normalized latency and average batched requests vs request rate, per policy.

Five policies (paged; Orca Oracle / Pow2 / Max = contiguous reservation with iteration-level
batching; FasterTransformer = max reservation with request-level batching), on ShareGPT-like and
Alpaca-like traces. Simulated (default): OPT-13B on one A100-40GB. ``--real``: the real engine
on this CPU with the default model and a pool small enough that memory binds (slow: the lead
runs it). A policy's *sustained rate* is the highest rate whose normalized latency stays under
``--slo`` seconds per output token (default: 4x the lowest latency any policy reached). Real runs
are short, so they also print each policy's *capacity*: the most requests/s it served (with
``--rates 100`` every request arrives at once and the served rate is the capacity).

``--kv-cache-dtype`` runs the experiment once per KV cache format, at the same memory: a smaller
format gives the pool more blocks (and the roofline cheaper KV reads), and the sustained rate is
printed per (system, KV dtype) against one SLO (from the first dtype listed). The default, ``auto``
alone, is the paper's fp16.

    .venv/bin/python benchmarks/paper_fig12_13_latency.py --trace sharegpt alpaca
    .venv/bin/python benchmarks/paper_fig12_13_latency.py --trace sharegpt --kv-cache-dtype auto int8
    .venv/bin/python benchmarks/paper_fig12_13_latency.py --real --trace sharegpt --rates 0.25 0.35 0.5 0.6 \
        --num-requests 24 --policies paged orca-oracle
    .venv/bin/python benchmarks/paper_fig12_13_latency.py --real --trace sharegpt --rates 100 --num-requests 32
"""

from __future__ import annotations

import argparse

from paper_common import REAL_MAX_MODEL_LEN, make_real_engine, pyplot, real_trace, run_real_trace, save_png, write_json

from pagedllm.kv_cache_format import KV_CACHE_DTYPES, parse_kv_cache_dtype
from pagedllm.simulator import (
    MODEL_SHAPES,
    POLICIES,
    CostModel,
    SimConfig,
    get_hardware,
    get_model_shape,
    kv_pool_blocks,
    make_trace,
    simulate,
    sustained_rate,
)

# Real runs: ShareGPT's chatbot limits (1024 + 1024) scaled onto 256 + 256; Alpaca fits as it is.
REAL_LENGTH_SCALE = {"sharegpt": 0.25, "alpaca": 1.0}
DEFAULT_RATES = {"sharegpt": [0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 6], "alpaca": [5, 10, 15, 20, 25, 30, 40, 50]}


def pool_blocks(args: argparse.Namespace, kv_cache_dtype: str) -> int:
    """KV blocks for ``kv_cache_dtype`` in the memory the experiment gives the model dtype's pool."""
    if not args.real:
        shape = get_model_shape(args.model_config, kv_cache_dtype)
        return kv_pool_blocks(shape, get_hardware(args.hardware), args.block_size, 2560)
    # --num-kv-blocks counts blocks of the default model's float32 cache (make_real_engine runs it
    # in float32); a smaller format gets the blocks that the same bytes hold.
    auto = MODEL_SHAPES["smollm2-135m"]
    return args.num_kv_blocks * auto.kv_bytes_per_token // auto.with_kv_cache_dtype(kv_cache_dtype).kv_bytes_per_token


def run_one(args: argparse.Namespace, trace_kind: str, policy: str, rate: float, kv_cache_dtype: str,
            blocks: int) -> dict:
    if args.real:
        scale = args.length_scale if args.length_scale is not None else REAL_LENGTH_SCALE[trace_kind]
        trace = real_trace(trace_kind, args.num_requests, rate, args.seed, scale)
        engine = make_real_engine(policy, blocks, args.block_size, max_model_len=REAL_MAX_MODEL_LEN,
                                  num_threads=args.num_threads, kv_cache_dtype=kv_cache_dtype)
        return run_real_trace(engine, trace)
    trace = make_trace(trace_kind, args.num_requests, rate, args.seed)
    shape, hw = get_model_shape(args.model_config, kv_cache_dtype), get_hardware(args.hardware)
    config = SimConfig(policy=policy, block_size=args.block_size, num_gpu_blocks=blocks,
                       max_model_len=shape.max_model_len, track_kv_waste=False)
    return simulate(trace, CostModel.from_hardware(shape, hw), config).row()


def system_name(policy: str, kv_cache_dtype: str, kv_cache_dtypes: list[str]) -> str:
    """A policy's name, with its KV dtype when the run compares formats (plain names otherwise, as before)."""
    return policy if kv_cache_dtypes == ["auto"] else f"{policy} [{kv_cache_dtype}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real", action="store_true")
    parser.add_argument("--trace", nargs="+", default=["sharegpt", "alpaca"])
    parser.add_argument("--rates", type=float, nargs="+", default=None)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--model-config", default="opt-13b")
    parser.add_argument("--hardware", default="a100-40gb")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=64,
                        help="--real only (blocks of the float32 cache; other KV dtypes get the same bytes)")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=KV_CACHE_DTYPES,
                        help="KV cache formats to compare at the same memory (auto = the model dtype)")
    parser.add_argument("--length-scale", type=float, default=None,
                        help="--real only: trace lengths x this (default: ShareGPT 0.25, Alpaca 1)")
    parser.add_argument("--num-threads", type=int, default=None, help="--real only: torch threads")
    parser.add_argument("--slo", type=float, default=None, help="normalized latency bound, s/token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=None, help="results/<name>.json|png (default by --real)")
    args = parser.parse_args()
    # Canonical names, each once ("fp8" and "fp8_e4m3" are one format).
    args.kv_cache_dtype = list(dict.fromkeys(parse_kv_cache_dtype(d).name for d in args.kv_cache_dtype))

    if args.real:
        label = f"real, this CPU, SmolLM2-135M, {args.num_kv_blocks} x {args.block_size}-token KV blocks"
    else:
        label = f"SIMULATED, {args.model_config} on {args.hardware}"
    report = {"label": label, "args": vars(args), "traces": {}}
    kv_dtypes = args.kv_cache_dtype
    blocks = {kv: pool_blocks(args, kv) for kv in kv_dtypes}
    for trace_kind in args.trace:
        rates = args.rates or DEFAULT_RATES[trace_kind]
        table: dict[str, list[dict]] = {}
        for kv in kv_dtypes:
            kv_bytes = get_model_shape("smollm2-135m" if args.real else args.model_config, kv).kv_bytes_per_token
            print(f"\n{trace_kind} ({label}), KV {kv}: {kv_bytes / 1024:g} KiB/token, {blocks[kv]} blocks; "
                  "normalized latency s/token (avg batched requests)")
            print(f"{'rate':>6} " + " ".join(f"{p:>20}" for p in args.policies))
            for policy in args.policies:
                table[system_name(policy, kv, kv_dtypes)] = []
            for rate in rates:
                cells = []
                for policy in args.policies:
                    row = run_one(args, trace_kind, policy, rate, kv, blocks[kv])
                    table[system_name(policy, kv, kv_dtypes)].append(
                        {"rate": rate, **row, "kv_cache_dtype": kv, "num_gpu_blocks": blocks[kv]})
                    cells.append(f"{row['normalized_latency_s']:>12.4f} ({row['avg_batched_requests']:>5.1f})")
                print(f"{rate:>6.2f} " + " ".join(cells))
        # One SLO for every KV dtype, so that their sustained rates compare, set by the first one listed:
        # its rates are then those of a run of it alone.
        floor = min(r["normalized_latency_s"] for rows in table.values() for r in rows
                    if r["kv_cache_dtype"] == kv_dtypes[0])
        slo = args.slo or 4 * floor
        sustained = {p: sustained_rate([r["rate"] for r in rows], [r["normalized_latency_s"] for r in rows], slo)
                     for p, rows in table.items()}
        print(f"sustained rate (normalized latency <= {slo:.4f} s/token): " +
              ", ".join(f"{p} {r:g}" for p, r in sustained.items()))
        for kv in kv_dtypes:
            paged, oracle = (sustained.get(system_name(p, kv, kv_dtypes)) for p in ("paged", "orca-oracle"))
            if oracle and paged is not None:
                suffix = "" if kv_dtypes == ["auto"] else f" (KV {kv})"
                print(f"paged / orca-oracle sustained rate{suffix}: {paged / oracle:.2f}x")
        if kv_dtypes != ["auto"]:
            print("max sustained rate (req/s) per system and KV dtype:")
            print(f"{'system':<18} " + " ".join(f"{kv:>10}" for kv in kv_dtypes))
            for policy in args.policies:
                print(f"{policy:<18} " + " ".join(f"{sustained[system_name(policy, kv, kv_dtypes)]:>10g}"
                                                   for kv in kv_dtypes))
        entry = {"slo_s_per_token": slo, "sustained_rate": sustained, "rows": table,
                 "kv_cache_dtypes": kv_dtypes, "num_gpu_blocks": blocks}
        if args.real:
            # A short real run cannot show a queue growing without bound; what a policy sustains
            # forever is its capacity: the most requests/s it served at any offered rate (measure it
            # with a rate far above, e.g. --rates 100: every request arrives at once).
            capacity = {p: max(r["throughput_req_s"] for r in rows) for p, rows in table.items()}
            print("capacity (most requests/s served): " + ", ".join(f"{p} {c:.3f}" for p, c in capacity.items()))
            if capacity.get("orca-oracle") and "paged" in capacity:
                print(f"paged / orca-oracle capacity: {capacity['paged'] / capacity['orca-oracle']:.2f}x")
            entry["capacity_req_s"] = capacity
        report["traces"][trace_kind] = entry
    name = args.name or ("paper_fig12_13_latency_real" if args.real else "paper_fig12_13_latency")
    write_json(name, report)
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(2, len(report["traces"]), figsize=(5 * len(report["traces"]), 6), squeeze=False)
    for col, (trace_kind, data) in enumerate(report["traces"].items()):
        for policy, rows in data["rows"].items():
            rates = [r["rate"] for r in rows]
            axes[0][col].plot(rates, [r["normalized_latency_s"] for r in rows], marker="o", label=policy)
            axes[1][col].plot(rates, [r["avg_batched_requests"] for r in rows], marker="o", label=policy)
        axes[0][col].set_ylim(0, 4 * data["slo_s_per_token"])
        axes[0][col].set_title(f"{trace_kind} ({label})", fontsize=9)
        axes[0][col].set_ylabel("normalized latency (s/token)")
        axes[1][col].set_ylabel("avg batched requests")
        axes[1][col].set_xlabel("request rate (req/s)")
    axes[0][0].legend(fontsize=7)
    save_png(fig, name)


if __name__ == "__main__":
    main()
