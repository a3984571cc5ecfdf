"""`pagedllm simulate ...`: the real scheduler on paper-scale hardware, timed by a cost model.

    pagedllm simulate --model-config opt-13b --hardware a100-40gb --trace sharegpt --rate 1 2 3
    pagedllm simulate --model-config opt-13b --rate 1 2 3 --kv-cache-dtype int8   # 8-bit KV cache
    pagedllm simulate --model-config opt-13b --rate 8 16 24 --replicas 8 --router round_robin  # data parallel

The lead's cli.py calls ``add_simulate_parser(subparsers)``; this module runs alone too
(``python -m pagedllm.entrypoints.simulate_cli ...``).
"""

from __future__ import annotations

import argparse
import json
import sys

from pagedllm.config import KV_CACHE_DTYPES
from pagedllm.serving.router import ROUTER_POLICIES
from pagedllm.simulator import (
    HARDWARE_PRESETS,
    MODEL_SHAPES,
    POLICIES,
    CostModel,
    SimConfig,
    get_hardware,
    get_model_shape,
    kv_pool_blocks,
    make_trace,
    simulate,
)


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``simulate`` sub-command to an argparse subparsers object."""
    parser = subparsers.add_parser("simulate", help="simulate serving on paper-scale hardware (cost model)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", default="opt-13b",
                        help=f"{', '.join(MODEL_SHAPES)} or a HF config.json (or its folder)")
    parser.add_argument("--hardware", default="a100-40gb", help=f"{', '.join(HARDWARE_PRESETS)} or cpu-measured")
    parser.add_argument("--trace", default="sharegpt", help="sharegpt, alpaca (synthetic) or a ShareGPT JSON file")
    parser.add_argument("--rate", type=float, nargs="+", default=[1.0], help="request rates (req/s), Poisson")
    parser.add_argument("--num-requests", type=int, default=500)
    parser.add_argument("--policy", nargs="+", default=["paged"], choices=[*POLICIES, "all"])
    parser.add_argument("--n", type=int, default=1, help="parallel samples per request")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="override the paper's pool sizing")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="KV cache storage (auto = the model dtype): sets the KV bytes per token, hence the "
                             "pool's blocks and the roofline's KV reads (a calibrated --cost-model is used as fitted)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2560)
    parser.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap", "auto"])
    parser.add_argument("--swap-blocks", type=int, default=0, help="CPU swap pool, in blocks")
    parser.add_argument("--cost-model", default=None, help="a calibrated cost-model JSON (paper_calibrate.py)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="data-parallel engines, each with the whole --hardware and KV pool")
    parser.add_argument("--router", default="prefix", choices=ROUTER_POLICIES,
                        help="which replica gets each request (pagedllm/serving/router.py); with --replicas > 1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.set_defaults(func=run_simulate)
    return parser


def run_simulate(args: argparse.Namespace) -> int:
    """The sub-command: print the table (and write JSON); returns the exit status."""
    simulate_rows(args)
    return 0


def simulate_rows(args: argparse.Namespace) -> list[dict]:
    """Run every (policy, rate) of ``args``, print one table row each, return the rows."""
    shape = get_model_shape(args.model_config, args.kv_cache_dtype)
    hw = get_hardware(args.hardware)
    cost_model = CostModel.from_json(args.cost_model) if args.cost_model else CostModel.from_hardware(shape, hw)
    num_blocks = args.num_gpu_blocks or kv_pool_blocks(shape, hw, args.block_size, args.max_num_batched_tokens)
    policies = list(POLICIES) if "all" in args.policy else args.policy
    print(f"SIMULATED: {shape.name} on {hw.name}, KV {shape.kv_cache_dtype} "
          f"({shape.kv_bytes_per_token / 1024:g} KiB/token), {num_blocks} KV blocks of {args.block_size} tokens "
          f"({num_blocks * args.block_size} token slots), trace {args.trace}, {args.num_requests} requests")
    print(f"cost model: {cost_model.source}")
    if args.replicas > 1:
        print(f"{args.replicas} replicas (each the hardware and KV pool above), router {args.router}; "
              "batched req is per replica")
    header = f"{'policy':<18} {'rate':>6} {'norm.lat s/tok':>14} {'batched req':>11} {'preempted':>9} " \
             f"{'token%':>7} {'reserv%':>7} {'intern%':>7} {'extern%':>7}"
    print(header)
    rows = []
    for policy in policies:
        for rate in args.rate:
            trace = make_trace(args.trace, args.num_requests, rate, args.seed, n=args.n)
            config = SimConfig(
                policy=policy, block_size=args.block_size, num_gpu_blocks=num_blocks, num_cpu_blocks=args.swap_blocks,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=shape.max_model_len, preemption_mode=args.preemption_mode,
                num_replicas=args.replicas, router=args.router,
            )
            result = simulate(trace, cost_model, config)
            used = result.kv_waste.get("fraction_of_used", {})
            shares = " ".join(f"{100 * used.get(k, 0):>7.1f}" for k in ("token", "reserved", "internal", "external"))
            print(f"{policy:<18} {rate:>6.2f} {result.normalized_latency_s:>14.4f} "
                  f"{result.avg_batched_requests:>11.1f} {result.num_preempted:>9d} {shares}")
            rows.append({**result.row(), "rate": rate, "kv_waste": result.kv_waste, "model": shape.name,
                         "hardware": hw.name, "trace": args.trace, "block_size": args.block_size,
                         "num_gpu_blocks": num_blocks, "kv_cache_dtype": shape.kv_cache_dtype,
                         "kv_bytes_per_token": shape.kv_bytes_per_token})
            if args.replicas > 1:
                rows[-1].update(replicas=args.replicas, router=args.router, router_stats=result.router_stats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm")
    add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
