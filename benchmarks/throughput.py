"""Offline throughput, after vLLM's benchmark_throughput: pagedllm against transformers generate().

N requests with random token-id prompts and fixed output lengths (EOS ignored, greedy). The same
prompts run through Hugging Face transformers `generate()` in padded static batches, the naive
baseline users start from, in the same process; engines are interleaved over repeats and the
medians and their ratio are printed (this machine is shared and noisy).

    .venv/bin/python benchmarks/throughput.py --num-prompts 64 --input-len 16 256 --output-len 16 256

``--kv-cache-dtype auto int8 ...`` runs one engine per KV cache dtype side by side at the same
``--kv-cache-memory`` (interleaved over repeats, as the engines above) and reports per dtype the
KV blocks the memory buys, the median output tok/s, the peak number of sequences running at once
(sampled after every step), the preemptions, and each figure's ratio to auto. At a small
``--kv-cache-memory`` the pool, not the step, limits the batch, and a denser cache buys concurrency:

    .venv/bin/python benchmarks/throughput.py --dtype bfloat16 --kv-cache-dtype auto int8 fp8 \\
        --num-prompts 128 --input-len 16 512 --output-len 64 512 --kv-cache-memory 96MiB --hf-batch-sizes
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.models.loader import resolve_model_path  # noqa: E402


def make_requests(num: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    # Stay clear of the low ids, where tokenizers keep their special tokens.
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(*input_range))], rng.randint(*output_range))
        for _ in range(num)
    ]


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The default workload's settings (benchmarks that run it import these)."""
    parser.add_argument("--model", default=None, help="HF folder or GGUF (default: embedded SmolLM2-135M)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)


def run_pagedllm(llm: LLM, requests) -> tuple[float, int]:
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True) for _, out in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert llm.llm_engine.get_stats()["gpu_blocks_used"] == 0
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def run_pagedllm_stepped(llm: LLM, requests) -> dict[str, float]:
    """``run_pagedllm`` driving the engine one step at a time (as ``LLM.generate`` does), to see how
    many sequences the pool lets run at once: the running queue is sampled after every step."""
    engine = llm.llm_engine
    before = engine.get_stats()
    start = time.perf_counter()
    for ids, out in requests:
        engine.add_request(engine.next_request_id(), {"prompt_token_ids": ids},
                           SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True))
    produced = peak = running_sum = steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                produced += sum(len(c.token_ids) for c in output.outputs)
        # One sequence per request here, so groups are sequences.
        running = len(engine.scheduler.running)
        peak = max(peak, running)
        running_sum += running
        steps += 1
    elapsed = time.perf_counter() - start
    after = engine.get_stats()
    assert after["gpu_blocks_used"] == 0
    return {
        "elapsed": elapsed,
        "produced": produced,
        "tok_per_s": produced / elapsed,
        "peak_running": peak,
        "mean_running": running_sum / max(steps, 1),
        "preemptions": after["num_preempted"] - before["num_preempted"],
        "steps": steps,
    }


# The bars of a quantized KV cache against auto at the same memory: (output tok/s, peak running).
KV_BARS = {"int8": (1.6, 1.9), "fp8": (1.6, 1.9), "fp8_e4m3": (1.6, 1.9), "fp8_e5m2": (1.6, 1.9)}


def print_kv_table(kv_runs: dict[str, list[dict]], blocks: dict[str, int]) -> dict[str, dict]:
    """Medians per KV dtype and their ratios to auto (or to the first dtype run without auto)."""
    summary = {}
    for name, runs in kv_runs.items():
        summary[name] = {
            "num_gpu_blocks": blocks[name],
            "tok_per_s": statistics.median(r["tok_per_s"] for r in runs),
            "peak_running": statistics.median(r["peak_running"] for r in runs),
            "mean_running": statistics.median(r["mean_running"] for r in runs),
            "preemptions": statistics.median(r["preemptions"] for r in runs),
        }
    ref_name = "auto" if "auto" in summary else next(iter(summary))
    ref = summary[ref_name]
    print(f"\nKV cache dtypes at the same KV memory (ratios to {ref_name}; medians over repeats):")
    print("| KV dtype | KV blocks | output tok/s | peak running | mean running | preemptions "
          "| tok/s ratio | blocks ratio | peak ratio | bar (tok/s, peak) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, row in summary.items():
        row["tok_per_s_ratio"] = row["tok_per_s"] / ref["tok_per_s"]
        row["blocks_ratio"] = row["num_gpu_blocks"] / ref["num_gpu_blocks"]
        row["peak_ratio"] = row["peak_running"] / ref["peak_running"]
        verdict = ""
        if name in KV_BARS and ref_name == "auto":
            min_speed, min_peak = KV_BARS[name]
            row["pass"] = row["tok_per_s_ratio"] >= min_speed and row["peak_ratio"] >= min_peak
            verdict = (f">= {min_speed}x, >= {min_peak}x: "
                       f"{'pass' if row['tok_per_s_ratio'] >= min_speed else 'FAIL'}, "
                       f"{'pass' if row['peak_ratio'] >= min_peak else 'FAIL'}")
        print(f"| {name} | {row['num_gpu_blocks']} | {row['tok_per_s']:.1f} | {row['peak_running']:g} | "
              f"{row['mean_running']:.1f} | {row['preemptions']:g} | {row['tok_per_s_ratio']:.2f}x | "
              f"{row['blocks_ratio']:.2f}x | {row['peak_ratio']:.2f}x | {verdict} |")
    return summary


def comm_delta(before: dict, after: dict, elapsed: float) -> dict[str, float]:
    """Tensor-parallel communication of one run: seconds in collectives, per step, share of the run."""
    steps = after["steps"] - before["steps"]
    comm = after["tp_comm_s"] - before["tp_comm_s"]
    sent = after["tp_broadcast_bytes"] - before["tp_broadcast_bytes"]
    return {
        "comm_s": comm,
        "all_reduce_s": after["tp_all_reduce_s"] - before["tp_all_reduce_s"],
        "gather_s": after["tp_gather_s"] - before["tp_gather_s"],
        "broadcast_s": after["tp_broadcast_s"] - before["tp_broadcast_s"],
        "comm_ms_per_step": 1e3 * comm / max(steps, 1),
        "comm_share": comm / elapsed,
        "message_bytes_per_step": sent / max(steps, 1),
        "steps": steps,
    }


def load_hf_model(model: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if model.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model), gguf_file=os.path.basename(model), torch_dtype=dtype
        ).eval()
    return AutoModelForCausalLM.from_pretrained(model, torch_dtype=dtype, local_files_only=True).eval()


@torch.inference_mode()
def run_hf(hf_model, requests, batch_size: int, pad_id: int) -> tuple[float, int]:
    """Static batches in arrival order; each batch runs until its longest output is done."""
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids, _ in batch])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch])
        max_new = max(out for _, out in batch)
        hf_model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad_id,
        )
        useful += sum(out for _, out in batch)
    return time.perf_counter() - start, useful


def profile_run(llm: LLM, requests) -> None:
    """Where the time goes: the engine's phase breakdown, then torch.profiler's op table (second run)."""
    from torch.profiler import ProfilerActivity, profile

    from pagedllm.step_timing import format_breakdown

    engine = llm.llm_engine
    steps_before = engine.num_steps
    engine.step_timer.start()
    run_pagedllm(llm, requests)
    engine.step_timer.stop()
    print(format_breakdown(engine.step_timer.summary(), engine.num_steps - steps_before))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_pagedllm(llm, requests)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hf-batch-sizes", type=int, nargs="*", default=[64], help="empty list skips transformers")
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"],
                        help="one engine per KV cache dtype (auto, int8, fp8, fp8_e5m2, int4), side by side")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (per rank)")
    parser.add_argument("--profile", action="store_true", help="print phase times and a torch.profiler table")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()

    model_path = resolve_model_path(args.model)
    llm_kwargs = dict(
        model=model_path, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
        block_size=args.block_size, seed=args.seed,
    )
    if args.tensor_parallel_size != 1:
        llm_kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    if args.num_threads is not None:
        llm_kwargs["num_threads"] = args.num_threads
    kv_mode = args.kv_cache_dtype != ["auto"]
    llms: dict[str, LLM] = {}
    for kv_dtype in args.kv_cache_dtype:
        llms[kv_dtype] = LLM(**llm_kwargs, **({"kv_cache_dtype": kv_dtype} if kv_mode else {}))
    llm = llms[args.kv_cache_dtype[0]]
    vocab = llm.llm_engine.vocab_size
    requests = make_requests(args.num_prompts, tuple(args.input_len), tuple(args.output_len), vocab, args.seed)
    total_out = sum(out for _, out in requests)
    print(f"{len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, {total_out} output tokens")
    blocks = {name: engine_llm.llm_engine.num_gpu_blocks for name, engine_llm in llms.items()}
    if kv_mode:
        print("KV blocks at " + str(args.kv_cache_memory) + ": " + ", ".join(f"{k} {v}" for k, v in blocks.items()))

    # Warm-up: first calls pay for allocator growth and kernel selection.
    for engine_llm in llms.values():
        run_pagedllm(engine_llm, requests[:4])
    if args.profile:
        profile_run(llm, requests)

    hf_model = None
    if args.hf_batch_sizes:
        hf_model = load_hf_model(model_path, getattr(torch, args.dtype))
        pad_id = llm.get_tokenizer().pad_token_id or 0
        run_hf(hf_model, requests[:2], 2, pad_id)

    def result_name(kv_dtype: str) -> str:
        return f"pagedllm kv={kv_dtype}" if kv_mode else "pagedllm"

    results: dict[str, list[float]] = {result_name(kv_dtype): [] for kv_dtype in args.kv_cache_dtype}
    for batch_size in args.hf_batch_sizes:
        results[f"transformers_bs{batch_size}"] = []
    comm_runs: list[dict[str, float]] = []
    kv_runs: dict[str, list[dict]] = {kv_dtype: [] for kv_dtype in args.kv_cache_dtype}
    for repeat in range(args.repeats):
        # Each repeat starts from another dtype, so no dtype always runs first (or last) in a round.
        shift = repeat % len(args.kv_cache_dtype)
        for kv_dtype in args.kv_cache_dtype[shift:] + args.kv_cache_dtype[:shift]:
            engine_llm = llms[kv_dtype]
            name = result_name(kv_dtype)
            before = engine_llm.llm_engine.get_stats()
            if kv_mode:
                run = run_pagedllm_stepped(engine_llm, requests)
                kv_runs[kv_dtype].append(run)
                elapsed, produced = run["elapsed"], run["produced"]
            else:
                elapsed, produced = run_pagedllm(engine_llm, requests)
            assert produced == total_out, (produced, total_out)
            results[name].append(produced / elapsed)
            line = f"[{repeat}] {name}: {len(requests) / elapsed:.2f} req/s, {produced / elapsed:.1f} output tok/s"
            if kv_mode:
                line += (f", peak {run['peak_running']} running (mean {run['mean_running']:.1f}),"
                         f" {run['preemptions']} preemptions, {run['steps']} steps")
            print(line)
            if args.tensor_parallel_size > 1:
                comm = comm_delta(before, engine_llm.llm_engine.get_stats(), elapsed)
                comm_runs.append(comm)
                print(
                    f"    tensor parallel: {comm['comm_s']:.2f} s in collectives ({100 * comm['comm_share']:.0f}% of"
                    f" the run; all-reduce {comm['all_reduce_s']:.2f} s, gather {comm['gather_s']:.2f} s, broadcast"
                    f" {comm['broadcast_s']:.2f} s), {comm['comm_ms_per_step']:.2f} ms/step over {comm['steps']}"
                    f" steps, {comm['message_bytes_per_step']:.0f} B control message/step"
                )
        for batch_size in args.hf_batch_sizes:
            elapsed, useful = run_hf(hf_model, requests, batch_size, pad_id)
            results[f"transformers_bs{batch_size}"].append(useful / elapsed)
            print(f"[{repeat}] transformers batch {batch_size}: {useful / elapsed:.1f} output tok/s")

    medians = {name: statistics.median(values) for name, values in results.items()}
    print("\nmedian output tok/s:")
    for name, value in medians.items():
        print(f"  {name:28s} {value:8.1f}")
    hf_names = [name for name in medians if name.startswith("transformers")]
    if hf_names:
        best = max(hf_names, key=medians.get)
        for kv_dtype in args.kv_cache_dtype:
            name = result_name(kv_dtype)
            print(f"{name} / best transformers ({best}): {medians[name] / medians[best]:.2f}x")
    kv_summary = print_kv_table(kv_runs, blocks) if kv_mode else None
    if args.json:
        with open(args.json, "w") as f:
            figures = {"args": vars(args), "tok_per_s": results, "median": medians, "tp_comm": comm_runs}
            if kv_mode:
                figures.update(kv_runs=kv_runs, kv_summary=kv_summary)
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
