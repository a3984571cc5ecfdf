"""Prompt attention per layer on a CPU: our AMX tile kernel against torch's fused SDPA, bfloat16.

For each (cached, new) shape: the tile kernel reading keys and values through a block table, and
SDPA as the backend calls it (lengths padded to its 32-token block; a chunk after a cached context
over its context gathered from the blocks, with the causal mask). The two alternate within each
round; medians over rounds. Heads default to the default model's (9 query heads, 3 KV heads of 64).

    .venv/bin/python benchmarks/prompt_attention.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import SDPA_CPU_BLOCK, gather_from_cache
from pagedllm.kernels.attention import prompt_attention_amx, prompt_attention_amx_supported

SHAPES = [(0, 64), (0, 128), (0, 256), (0, 448), (0, 1024), (0, 2048), (256, 256), (768, 256), (1750, 250)]


def sdpa_chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, cached: int,
               scale: float) -> torch.Tensor:
    new, total = q.shape[0], cached + q.shape[0]
    k = gather_from_cache(k_cache, table, total).transpose(1, 2)
    v = gather_from_cache(v_cache, table, total).transpose(1, 2)
    q = q.transpose(0, 1).unsqueeze(0)
    pad_q, pad_k = -new % SDPA_CPU_BLOCK, -total % SDPA_CPU_BLOCK
    q, k, v = F.pad(q, (0, 0, 0, pad_q)), F.pad(k, (0, 0, 0, pad_k)), F.pad(v, (0, 0, 0, pad_k))
    if cached == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    last = total - 1
    q_pos = torch.arange(cached, last + 1 + pad_q).clamp(max=last).unsqueeze(1)
    mask = torch.arange(total + pad_k).unsqueeze(0) <= q_pos
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def time_shape(cached: int, new: int, args: argparse.Namespace, scale: float) -> tuple[float, float]:
    """Median ms of the tile kernel and of SDPA for one chunk of ``new`` tokens after ``cached``."""
    total = cached + new
    num_blocks = -(-total // args.block_size)
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16)
    v_cache = torch.randn(shape, dtype=torch.bfloat16)
    table = torch.randperm(num_blocks).unsqueeze(0)
    q = torch.randn(new, args.num_heads, args.head_dim, dtype=torch.bfloat16)
    starts, lens = torch.tensor([0, new]), torch.tensor([total])
    runs = {
        "amx": lambda: prompt_attention_amx(q, k_cache, v_cache, table, starts, lens, scale),
        "sdpa": lambda: sdpa_chunk(q, k_cache, v_cache, table, cached, scale),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():  # warm-up
        run()
    for _ in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return 1e3 * statistics.median(times["amx"]), 1e3 * statistics.median(times["sdpa"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    probe = torch.zeros(1, 1, args.head_dim, dtype=torch.bfloat16)
    if not prompt_attention_amx_supported(probe, probe):
        raise SystemExit("the AMX prompt attention does not run here (needs AMX-BF16 and a head_dim multiple of 64)")
    torch.manual_seed(0)
    scale = args.head_dim**-0.5
    print(f"{torch.get_num_threads()} threads; heads {args.num_heads} / {args.num_kv_heads} of {args.head_dim}; "
          f"ms per layer, medians of {args.rounds}")
    print(f"{'cached':>7} {'new':>6} {'amx':>8} {'sdpa':>8} {'amx/sdpa':>9}")
    for cached, new in SHAPES:
        amx, sdpa = time_shape(cached, new, args, scale)
        print(f"{cached:>7} {new:>6} {amx:>8.2f} {sdpa:>8.2f} {amx / sdpa:>9.2f}")

if __name__ == "__main__":
    main()
