"""Figure 18b: normalized latency of the paged policy vs block size (1..256), both traces.

Simulated: OPT-13B on one A100-40GB, the paper's pool sizing, one fixed rate per trace (the
paper used ShareGPT at 1.5 req/s... we take rates near paged's knee so block size matters).
Small blocks waste nothing but are many; large blocks waste up to a block per sequence (the
pool holds fewer requests). The simulator's cost model does not charge small blocks a kernel
penalty (the paper's GPU kernel parallelism argument), so the left side reads as a lower bound.

    .venv/bin/python benchmarks/paper_fig18b_block_size.py
"""

from __future__ import annotations

import argparse

from paper_common import pyplot, save_png, write_json

from pagedllm.simulator import CostModel, SimConfig, get_hardware, get_model_shape, kv_pool_blocks, make_trace, simulate

BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=BLOCK_SIZES)
    parser.add_argument("--sharegpt-rate", type=float, default=3.0)
    parser.add_argument("--alpaca-rate", type=float, default=30.0)
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    shape, hw = get_model_shape("opt-13b"), get_hardware("a100-40gb")
    cost = CostModel.from_hardware(shape, hw)
    rows = []
    print("Figure 18b (SIMULATED, OPT-13B on A100-40GB): normalized latency s/token, paged")
    print(f"{'block':>6} {'sharegpt':>10} {'alpaca':>10} {'token% sharegpt':>16}")
    for block_size in args.block_sizes:
        row = {"block_size": block_size, "simulated": True}
        for trace_kind, rate in (("sharegpt", args.sharegpt_rate), ("alpaca", args.alpaca_rate)):
            trace = make_trace(trace_kind, args.num_requests, rate, args.seed)
            blocks = kv_pool_blocks(shape, hw, block_size, 2560)
            result = simulate(trace, cost, SimConfig(policy="paged", block_size=block_size, num_gpu_blocks=blocks))
            row[trace_kind] = result.normalized_latency_s
            row[f"{trace_kind}_token_fraction"] = result.kv_waste["fraction_of_used"]["token"]
        rows.append(row)
        print(f"{block_size:>6} {row['sharegpt']:>10.4f} {row['alpaca']:>10.4f} "
              f"{100 * row['sharegpt_token_fraction']:>16.1f}")
    write_json("paper_fig18b_block_size", {"rates": {"sharegpt": args.sharegpt_rate, "alpaca": args.alpaca_rate},
                                           "rows": rows})
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for trace_kind in ("sharegpt", "alpaca"):
            ax.plot([r["block_size"] for r in rows], [r[trace_kind] for r in rows], marker="o", label=trace_kind)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.set_title("Figure 18b (SIMULATED, OPT-13B, A100-40GB)", fontsize=9)
        ax.legend()
        save_png(fig, "paper_fig18b_block_size")


if __name__ == "__main__":
    main()
