"""Figures 12 and 13: normalized latency and average batched requests vs request rate, per policy.

Five policies (paged; Orca Oracle / Pow2 / Max = contiguous reservation with iteration-level
batching; FasterTransformer = max reservation with request-level batching), on ShareGPT-like and
Alpaca-like traces. Simulated (default): OPT-13B on one A100-40GB. ``--real``: the real engine
on this CPU with the default model and a pool small enough that memory binds (slow: the lead
runs it). A policy's *sustained rate* is the highest rate whose normalized latency stays under
``--slo`` seconds per output token (default: 4x the lowest latency any policy reached). Real runs
are short, so they also print each policy's *capacity*: the most requests/s it served (with
``--rates 100`` every request arrives at once and the served rate is the capacity).

    .venv/bin/python benchmarks/paper_fig12_13_latency.py --trace sharegpt alpaca
    .venv/bin/python benchmarks/paper_fig12_13_latency.py --real --trace sharegpt --rates 0.25 0.35 0.5 0.6 \
        --num-requests 24 --policies paged orca-oracle
    .venv/bin/python benchmarks/paper_fig12_13_latency.py --real --trace sharegpt --rates 100 --num-requests 32
"""

from __future__ import annotations

import argparse

from paper_common import REAL_MAX_MODEL_LEN, make_real_engine, pyplot, real_trace, run_real_trace, save_png, write_json

from pagedllm.simulator import (
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


def run_one(args, trace_kind: str, policy: str, rate: float) -> dict:
    if args.real:
        scale = args.length_scale if args.length_scale is not None else REAL_LENGTH_SCALE[trace_kind]
        trace = real_trace(trace_kind, args.num_requests, rate, args.seed, scale)
        engine = make_real_engine(policy, args.num_kv_blocks, args.block_size, max_model_len=REAL_MAX_MODEL_LEN,
                                  num_threads=args.num_threads)
        return run_real_trace(engine, trace)
    trace = make_trace(trace_kind, args.num_requests, rate, args.seed)
    shape, hw = get_model_shape(args.model_config), get_hardware(args.hardware)
    blocks = kv_pool_blocks(shape, hw, args.block_size, 2560)
    config = SimConfig(policy=policy, block_size=args.block_size, num_gpu_blocks=blocks,
                       max_model_len=shape.max_model_len, track_kv_waste=False)
    return simulate(trace, CostModel.from_hardware(shape, hw), config).row()


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
    parser.add_argument("--num-kv-blocks", type=int, default=64, help="--real only")
    parser.add_argument("--length-scale", type=float, default=None,
                        help="--real only: trace lengths x this (default: ShareGPT 0.25, Alpaca 1)")
    parser.add_argument("--num-threads", type=int, default=None, help="--real only: torch threads")
    parser.add_argument("--slo", type=float, default=None, help="normalized latency bound, s/token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=None, help="results/<name>.json|png (default by --real)")
    args = parser.parse_args()

    if args.real:
        label = f"real, this CPU, SmolLM2-135M, {args.num_kv_blocks} x {args.block_size}-token KV blocks"
    else:
        label = f"SIMULATED, {args.model_config} on {args.hardware}"
    report = {"label": label, "args": vars(args), "traces": {}}
    for trace_kind in args.trace:
        rates = args.rates or DEFAULT_RATES[trace_kind]
        print(f"\n{trace_kind} ({label}): normalized latency s/token (avg batched requests)")
        print(f"{'rate':>6} " + " ".join(f"{p:>20}" for p in args.policies))
        table = {policy: [] for policy in args.policies}
        for rate in rates:
            cells = []
            for policy in args.policies:
                row = run_one(args, trace_kind, policy, rate)
                table[policy].append({"rate": rate, **row})
                cells.append(f"{row['normalized_latency_s']:>12.4f} ({row['avg_batched_requests']:>5.1f})")
            print(f"{rate:>6.2f} " + " ".join(cells))
        floor = min(r["normalized_latency_s"] for rows in table.values() for r in rows)
        slo = args.slo or 4 * floor
        sustained = {p: sustained_rate([r["rate"] for r in rows], [r["normalized_latency_s"] for r in rows], slo)
                     for p, rows in table.items()}
        print(f"sustained rate (normalized latency <= {slo:.4f} s/token): " +
              ", ".join(f"{p} {r:g}" for p, r in sustained.items()))
        if sustained.get("orca-oracle"):
            print(f"paged / orca-oracle sustained rate: {sustained['paged'] / sustained['orca-oracle']:.2f}x")
        entry = {"slo_s_per_token": slo, "sustained_rate": sustained, "rows": table}
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
