"""Figure 2: where the KV memory goes, per allocation policy, on a ShareGPT-like trace.

Simulated (default): OPT-13B on one A100-40GB, the paper's pool sizing, a request rate that
keeps memory full. ``--real``: the real engine on this CPU (default model, a small pool).
Categories are defined in pagedllm/core/waste.py; percentages are of the KV memory in use
(free slots excluded), time-averaged. The bar: paged >= 96% token states; contiguous-max <= 30%.

    .venv/bin/python benchmarks/paper_fig2_waste.py
    .venv/bin/python benchmarks/paper_fig2_waste.py --real --num-requests 40 --rate 2
"""

from __future__ import annotations

import argparse

from paper_common import REAL_MAX_MODEL_LEN, make_real_engine, pyplot, real_trace, run_real_trace, save_png, write_json

from pagedllm.simulator import CostModel, SimConfig, get_hardware, get_model_shape, kv_pool_blocks, make_trace, simulate

POLICIES = ("paged", "orca-oracle", "orca-pow2", "orca-max")
CATEGORIES = ("token", "reserved", "internal", "external")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real", action="store_true", help="run the real engine on this CPU instead")
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=96, help="--real only: the pool")
    parser.add_argument("--length-scale", type=float, default=0.25, help="--real only: trace lengths x this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=None, help="results/<name>.json|png (default by --real)")
    args = parser.parse_args()

    rows = []
    label = "real, this CPU, SmolLM2-135M" if args.real else "SIMULATED, OPT-13B on A100-40GB"
    print(f"Figure 2 ({label}), ShareGPT-like, rate {args.rate} req/s, {args.num_requests} requests")
    print(f"{'policy':<12} " + " ".join(f"{c + '%':>10}" for c in CATEGORIES) + f" {'batched':>8}")
    for policy in POLICIES:
        if args.real:
            trace = real_trace("sharegpt", args.num_requests, args.rate, args.seed, args.length_scale)
            engine = make_real_engine(policy, args.num_kv_blocks, args.block_size, max_model_len=REAL_MAX_MODEL_LEN)
            result = run_real_trace(engine, trace)
            waste, batched = result["kv_waste"], result["avg_batched_requests"]
        else:
            shape, hw = get_model_shape("opt-13b"), get_hardware("a100-40gb")
            blocks = kv_pool_blocks(shape, hw, args.block_size, 2560)
            trace = make_trace("sharegpt", args.num_requests, args.rate, args.seed)
            sim = simulate(trace, CostModel.from_hardware(shape, hw),
                           SimConfig(policy=policy, block_size=args.block_size, num_gpu_blocks=blocks))
            waste, batched = sim.kv_waste, sim.avg_batched_requests
        used = waste["fraction_of_used"]
        print(f"{policy:<12} " + " ".join(f"{100 * used[c]:>10.1f}" for c in CATEGORIES) + f" {batched:>8.1f}")
        rows.append({"policy": policy, "simulated": not args.real, "fraction_of_used": used,
                     "fraction_of_pool": waste["fraction_of_pool"], "avg_batched_requests": batched})
    name = args.name or ("paper_fig2_waste_real" if args.real else "paper_fig2_waste")
    write_json(name, {"label": label, "rate": args.rate, "num_requests": args.num_requests, "args": vars(args),
                      "rows": rows})
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        bottom = [0.0] * len(rows)
        for category in CATEGORIES:
            values = [100 * row["fraction_of_used"][category] for row in rows]
            ax.bar([row["policy"] for row in rows], values, bottom=bottom, label=category)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylabel("% of KV memory in use")
        ax.set_title(f"Figure 2 ({label})", fontsize=9)
        ax.legend(fontsize=8)
        save_png(fig, name)


if __name__ == "__main__":
    main()
