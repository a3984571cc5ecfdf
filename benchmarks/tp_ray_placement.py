"""Tensor parallelism with ranks as processes (mp) or as Ray actors placed by a placement group, side by side.

Each configuration generates the same greedy batch on a random checkpoint of Llama-3.2-1B's shape
(benchmarks/family_checkpoints.py; the embedded SmolLM2's 9 heads do not split in two); the figure is decode
throughput (generated tokens / wall time of the generate call), the median of --repeats runs, with
the time per step the engine spent in collectives. Ray's ranks run the same gloo collectives as
spawned ones, so on one node the two backends should match; the gap to one process is the cost of
splitting a model this small over cores of one machine (all-reduces twice a layer).

    .venv/bin/python benchmarks/tp_ray_placement.py
    .venv/bin/python benchmarks/tp_ray_placement.py --model PATH --batch 8 --max-tokens 32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from family_checkpoints import DEFAULT_OUT_DIR, checkpoint  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402

CONFIGS = {
    "tp1 x 1 thread": dict(tensor_parallel_size=1, num_threads=1),
    "tp1 x 2 threads": dict(tensor_parallel_size=1, num_threads=2),
    "tp2 mp (1 thread each)": dict(tensor_parallel_size=2, num_threads=1, distributed_executor_backend="mp"),
    "tp2 ray STRICT_PACK (1 thread each)": dict(tensor_parallel_size=2, num_threads=1,
                                                distributed_executor_backend="ray"),
}


def run_config(name: str, settings: dict, args: argparse.Namespace) -> dict:
    llm = LLM(model=args.model, dtype=args.dtype, device="cpu", num_kv_blocks=512, **settings)
    prompts = [f"Request {i}: write a short story about paged memory number {i}." for i in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm up
    rates, outputs = [], None
    for _ in range(args.repeats):
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        rates.append(sum(len(r.outputs[0].token_ids) for r in results) / elapsed)
        outputs = [r.outputs[0].token_ids for r in results]
    stats = llm.llm_engine.get_stats()
    llm.llm_engine.shutdown()
    return {"config": name, "tok_s": statistics.median(rates), "runs": rates,
            "comm_s_per_step": stats.get("tp_comm_s_per_step"), "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: a random checkpoint of Llama-3.2-1B's shape")
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where the random checkpoint is written")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.model is None:
        args.model = checkpoint("llama", args.out_dir)[0]
    import ray

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    rows = [run_config(name, settings, args) for name, settings in CONFIGS.items()]
    base = rows[0]
    # In bfloat16 a split model sums its partial products in another order than a whole one, so a random
    # checkpoint's near-tied logits may pick other tokens; the two tensor-parallel backends must agree.
    print(f"{'config':38s} {'tok/s':>8s} {'vs tp1x1':>9s} {'comm ms/step':>13s}  same greedy output as")
    for i, row in enumerate(rows):
        comm = row["comm_s_per_step"]
        comm_text = f"{comm * 1e3:.2f}" if comm is not None else "-"
        same = [other["config"] for other in rows[:i] if other["outputs"] == row["outputs"]]
        print(f"{row['config']:38s} {row['tok_s']:8.1f} {row['tok_s'] / base['tok_s']:8.2f}x {comm_text:>13s}  "
              f"{', '.join(same) or '-'}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([{k: v for k, v in row.items() if k != "outputs"} for row in rows], handle, indent=1)
    ray.shutdown()


if __name__ == "__main__":
    main()
