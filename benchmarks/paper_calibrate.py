"""Calibrate the simulator's cost model against real pagedllm runs on this CPU, and report its error.

Runs the real engine (default model) on a mixed workload, records every step's features and
wall time, fits ``CostModel.fit`` on the even steps and measures the error on the odd ones
(per-step relative error, and the error of the total time, which is what a simulated latency
sums). Writes results/paper_calibrate.json and pagedllm/simulator/cpu_calibration.json (the
fitted coefficients; ``--hardware cpu-measured`` / ``--cost-model`` read it).

    .venv/bin/python benchmarks/paper_calibrate.py --num-requests 16
"""

from __future__ import annotations

import argparse
import statistics

from paper_common import make_real_engine, run_real_trace, write_json

from pagedllm.simulator import CostModel, get_model_shape, synthetic_trace
from pagedllm.simulator.hardware import CPU_CALIBRATION_PATH


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()

    trace = synthetic_trace("alpaca", args.num_requests, args.rate, seed=7)
    for req in trace:  # longer prompts than Alpaca so that prefill sizes span a wide range
        req.prompt_len = min(256, req.prompt_len * 6)
        req.output_len = min(32, req.output_len)
    engine = make_real_engine("paged", args.num_kv_blocks, num_threads=args.num_threads)
    run_real_trace(engine, trace[:2])  # warm-up
    print(f"serving {len(trace)} requests on the real engine ...", flush=True)
    result = run_real_trace(engine, trace, record_steps=True)
    steps = result.pop("steps")
    train, test = steps[0::2], steps[1::2]
    model = CostModel.fit(train, source="fit to real pagedllm steps (SmolLM2-135M, this CPU)")
    errors = model.relative_errors(test)
    total_measured = sum(t for _, t in test)
    total_predicted = sum(model.step_time(f) for f, _ in test)
    summary = {
        "num_steps": len(steps),
        "coefficients": {k: getattr(model, k) for k in ("fixed_s", "per_prefill_token_s", "per_decode_seq_s",
                                                        "per_kv_token_read_s", "per_prefill_attn_pair_s")},
        "median_step_error": statistics.median(errors),
        "mean_step_error": statistics.fmean(errors),
        "p90_step_error": sorted(errors)[int(0.9 * len(errors))],
        "total_time_error": (total_predicted - total_measured) / total_measured,
    }
    print("held-out steps:", len(test))
    for key, value in summary.items():
        print(f"  {key}: {value}")
    shape = get_model_shape("smollm2-135m")
    # An effective CPU spec, so that --hardware cpu-measured works with any model shape.
    peak = 2 * shape.num_params / model.per_prefill_token_s if model.per_prefill_token_s else 1e11
    bandwidth = shape.weight_bytes / model.fixed_s if model.fixed_s else 1e10
    model.to_json(CPU_CALIBRATION_PATH, peak_flops=peak, mem_bandwidth=bandwidth, mem_bytes=16 * 2**30)
    write_json("paper_calibrate", summary)


if __name__ == "__main__":
    main()
