"""Figure 19 of the vLLM paper: preemption by swapping vs by recomputation, across block sizes.

For each block size, a set of sequences (``--num-seqs`` x ``--seq-len`` tokens, i.e. prompt +
generated tokens) holds its KV cache in the device pool. We time

* swap:      CacheEngine.swap_out then CacheEngine.swap_in of all their blocks, as the worker
             does it ((gpu, cpu) / (cpu, gpu) pairs, one indexing op over all layers each way);
             the block ids are a seeded shuffle of the pools, as after some serving;
* recompute: one prefill forward pass over the same tokens through the real model
             (ModelRunner.execute on a StepInput, writing the KV into the paged cache; no sampling).

Both are the same total number of tokens. Swapping copies one contiguous chunk of
block_size x kv_heads x head_dim elements per (layer, K/V, block): small blocks mean many
small copies (plus building the pair index tensors), large blocks approach a plain memcpy.
Recompute is measured at every block size too, to show it hardly depends on it.

On a CPU-only machine the "device" pool and the "CPU" pool are both host memory, so a swap is a
host memcpy (no PCIe): swapping looks far cheaper than on a GPU, where it crosses PCIe.

    .venv/bin/python benchmarks/swap_vs_recompute.py                      # default SmolLM2-135M
    .venv/bin/python benchmarks/swap_vs_recompute.py --model PATH --num-seqs 4 --seq-len 128 --repeats 3
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

import torch
from paper_common import pyplot, save_png, write_json

from pagedllm.config import CacheConfig
from pagedllm.models.loader import build_model, load_model_config
from pagedllm.sampling import Sampler
from pagedllm.worker.cache_engine import CacheEngine, kv_block_bytes
from pagedllm.worker.model_runner import ModelRunner, SeqStepInput, StepInput

BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
NAME = "swap_vs_recompute"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def measure_block_size(model, model_config, args, block_size: int, device: torch.device, rng: random.Random) -> dict:
    blocks_per_seq = -(-args.seq_len // block_size)
    num_blocks = args.num_seqs * blocks_per_seq
    # Pools a bit larger than needed, ids shuffled: the sequences' blocks are scattered, as in serving.
    pool_blocks = num_blocks + max(1, num_blocks // 4)
    cache_config = CacheConfig(block_size=block_size, num_kv_blocks=pool_blocks, enable_prefix_caching=False)
    engine = CacheEngine(model_config, cache_config, pool_blocks, pool_blocks, device, model_config.dtype)
    gpu_ids = rng.sample(range(pool_blocks), num_blocks)
    cpu_ids = rng.sample(range(pool_blocks), num_blocks)
    out_pairs = list(zip(gpu_ids, cpu_ids))
    in_pairs = list(zip(cpu_ids, gpu_ids))
    tables = [gpu_ids[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(args.num_seqs)]
    vocab = model_config.hf_config.vocab_size
    token_ids = [[rng.randrange(100, vocab) for _ in range(args.seq_len)] for _ in range(args.num_seqs)]
    step = StepInput(seqs=[
        SeqStepInput(seq_id=i, token_ids=token_ids[i], start_pos=0, block_table=tables[i], sampling_row=None)
        for i in range(args.num_seqs)
    ])
    runner = ModelRunner(model, block_size, device, Sampler(eos_token_id=None, vocab_size=vocab))
    generator = torch.Generator(device=device)

    def recompute() -> None:
        runner.execute(step, engine.kv_caches, generator)

    swap_out, swap_in, swap_total, recomp = [], [], [], []
    for rep in range(args.warmup + args.repeats):
        t_out = _timed(lambda: engine.swap_out(out_pairs), device)
        t_in = _timed(lambda: engine.swap_in(in_pairs), device)
        t_re = _timed(recompute, device)
        if rep >= args.warmup:
            swap_out.append(t_out)
            swap_in.append(t_in)
            swap_total.append(t_out + t_in)
            recomp.append(t_re)
    # Sanity: a round trip brings back exactly the KV that recompute wrote (both copies really moved data).
    written = engine.gpu_pool[:, :, gpu_ids].clone()
    engine.swap_out(out_pairs)
    engine.gpu_pool[:, :, gpu_ids] = 0
    engine.swap_in(in_pairs)
    roundtrip_ok = bool(written.abs().sum().item() > 0 and torch.equal(engine.gpu_pool[:, :, gpu_ids], written))
    tokens = args.num_seqs * args.seq_len
    row = {
        "block_size": block_size,
        "num_blocks": num_blocks,
        "block_bytes": kv_block_bytes(model_config, block_size, model_config.dtype),
        "swapped_bytes": num_blocks * kv_block_bytes(model_config, block_size, model_config.dtype),
        "swap_out_s": statistics.median(swap_out),
        "swap_in_s": statistics.median(swap_in),
        "swap_s": statistics.median(swap_total),
        "recompute_s": statistics.median(recomp),
        "swap_samples_s": swap_total,
        "recompute_samples_s": recomp,
        "swap_roundtrip_ok": roundtrip_ok,
    }
    row["swap_per_token_s"] = row["swap_s"] / tokens
    row["recompute_per_token_s"] = row["recompute_s"] / tokens
    row["swap_gb_per_s"] = 2 * row["swapped_bytes"] / row["swap_s"] / 1e9
    return row


def crossover(rows: list[dict]) -> str:
    """Where swap (falling with block size) meets recompute (flat), interpolated on a log2 axis."""
    diffs = [(r["block_size"], r["swap_s"] - r["recompute_s"]) for r in rows]
    if all(d <= 0 for _, d in diffs):
        return f"swap is faster than recompute at every block size measured ({diffs[0][0]}..{diffs[-1][0]})"
    if all(d > 0 for _, d in diffs):
        return f"recompute is faster than swap at every block size measured ({diffs[0][0]}..{diffs[-1][0]})"
    for (b0, d0), (b1, d1) in zip(diffs, diffs[1:]):
        if (d0 > 0) != (d1 > 0):
            x0, x1 = math.log2(b0), math.log2(b1)
            x = x0 + (x1 - x0) * d0 / (d0 - d1)
            faster = "swap" if d1 <= 0 else "recompute"
            extra = ""
            later = [b for b, d in diffs if b > b1 and (d <= 0) != (d1 <= 0)]
            if later:
                extra = f" (not monotone: the other side wins again at block size {later[0]})"
            return (f"curves cross between block sizes {b0} and {b1} (~{2 ** x:.1f} tokens, log2 interpolation); "
                    f"{faster} is faster from {b1} up{extra}")
    return "no crossing"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder / GGUF; default: SmolLM2-135M")
    parser.add_argument("--dtype", default="float32", help="model and KV dtype (auto, float32, bfloat16, ...)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=BLOCK_SIZES)
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256, help="prompt + generated tokens per sequence")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads on CPU (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=NAME, help="name of the JSON/PNG under benchmarks/results/")
    args = parser.parse_args()

    device = torch.device(args.device)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    model_config = load_model_config(args.model, dtype=args.dtype, max_model_len=None)
    if args.seq_len > model_config.max_model_len:
        parser.error(f"--seq-len {args.seq_len} exceeds the model's {model_config.max_model_len} positions")
    model = build_model(model_config, device)
    rng = random.Random(args.seed)
    tokens = args.num_seqs * args.seq_len
    cpu_only = device.type == "cpu"
    note = ("CPU-only run: the 'device' pool and the 'CPU' swap pool are both host memory, so a swap is a host "
            "memcpy (no PCIe transfer) -- swapping looks much cheaper than on a GPU."
            if cpu_only else f"device {device}: swaps cross PCIe between the GPU pool and a pinned host pool.")
    print(f"Figure 19: swap vs recompute, {model_config.model} ({model_config.dtype}, {model_config.num_layers} "
          f"layers, {model_config.num_kv_heads} KV heads x {model_config.head_dim}), device={device}, "
          f"threads={torch.get_num_threads()}")
    print(f"{args.num_seqs} sequences x {args.seq_len} tokens = {tokens} tokens; median of {args.repeats} "
          f"(after {args.warmup} warm-up)")
    print(f"NOTE: {note}")
    header = (f"{'block':>6} {'blocks':>7} {'MB':>8} {'out ms':>9} {'in ms':>9} {'swap ms':>9} {'recomp ms':>10} "
              f"{'swap us/tok':>12} {'recomp us/tok':>14} {'swap GB/s':>10} {'faster':>10}")
    print(header)
    rows = []
    for block_size in args.block_sizes:
        row = measure_block_size(model, model_config, args, block_size, device, rng)
        rows.append(row)
        faster = "swap" if row["swap_s"] <= row["recompute_s"] else "recompute"
        print(f"{block_size:>6} {row['num_blocks']:>7} {row['swapped_bytes'] / 1e6:>8.1f} "
              f"{1e3 * row['swap_out_s']:>9.3f} {1e3 * row['swap_in_s']:>9.3f} {1e3 * row['swap_s']:>9.3f} "
              f"{1e3 * row['recompute_s']:>10.2f} {1e6 * row['swap_per_token_s']:>12.3f} "
              f"{1e6 * row['recompute_per_token_s']:>14.2f} {row['swap_gb_per_s']:>10.2f} {faster:>10}", flush=True)
    cross = crossover(rows)
    padded = [b for b in args.block_sizes if args.seq_len % b]
    if padded:
        print(f"note: block sizes {padded} do not divide --seq-len {args.seq_len}: the last block of each sequence "
              "is partly empty and is swapped whole (more bytes than tokens)")
    recomp = [r["recompute_s"] for r in rows]
    spread = (max(recomp) - min(recomp)) / statistics.median(recomp)
    swaps = [r["swap_s"] for r in rows]
    print(f"crossover: {cross}")
    print(f"swap time, smallest vs largest block: {swaps[0] / swaps[-1]:.1f}x; "
          f"recompute spread across block sizes: {100 * spread:.0f}% of its median")
    write_json(args.output, {
        "figure": "vLLM paper Figure 19 (swap vs recompute overhead vs block size)",
        "model": model_config.model, "dtype": str(model_config.dtype), "device": str(device),
        "num_threads": torch.get_num_threads(), "num_seqs": args.num_seqs, "seq_len": args.seq_len,
        "tokens": tokens, "repeats": args.repeats, "warmup": args.warmup, "seed": args.seed,
        "note": note, "crossover": cross, "recompute_spread_fraction": spread, "rows": rows,
    })
    plt = pyplot()
    if plt is not None:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
        bs = [r["block_size"] for r in rows]
        ax1.plot(bs, [1e3 * r["swap_out_s"] for r in rows], marker="^", label="swap out")
        ax1.plot(bs, [1e3 * r["swap_in_s"] for r in rows], marker="v", label="swap in")
        ax1.plot(bs, [1e3 * r["recompute_s"] for r in rows], marker="s", label="recompute")
        ax1.set_ylabel("time (ms)")
        ax1.set_title("(a) total time", fontsize=9)
        ax2.plot(bs, [1e6 * r["swap_per_token_s"] for r in rows], marker="o", label="swap (out + in)")
        ax2.plot(bs, [1e6 * r["recompute_per_token_s"] for r in rows], marker="s", label="recompute")
        ax2.set_ylabel("time per token (us)")
        ax2.set_title("(b) time per token", fontsize=9)
        for ax in (ax1, ax2):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("block size (tokens)")
            ax.legend(fontsize=8)
        where = "CPU-only: both pools in host memory" if cpu_only else str(device)
        fig.suptitle(f"Figure 19: {tokens} tokens, {model_config.model.rstrip('/').split('/')[-1]} ({where})",
                     fontsize=9)
        save_png(fig, args.output)


if __name__ == "__main__":
    main()
