"""Figure 18a: paged decode attention vs attention over the same K/V stored contiguously.

Per (batch, context): K/V for every sequence are written into a paged cache (blocks of 16,
block tables shuffled so that blocks are scattered as in a long-running pool) and, separately,
into one contiguous [B, H, ctx, D] tensor. Timed: pagedllm's PagedAttention.forward on a decode
step (one query per sequence; it writes the new token's K/V and reads through the block tables)
against torch SDPA over the contiguous tensors. Shapes: OPT-13B's attention (40 heads x 128) by
default. The paper's kernel was 20-26% slower than FasterTransformer's; the bar here: <= 26%.

    .venv/bin/python benchmarks/paper_fig18a_kernel.py --batch 8 32 --context 64 128 256 512 1024 2048
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from paper_common import pyplot, save_png, write_json

from pagedllm.attention import AttentionMetadata, PagedAttention


def bench(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
            repeats: int, device: str, dtype: torch.dtype) -> tuple[float, float, float]:
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1  # scattered blocks, as in a busy pool
    tables = order[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(device)
    keys = torch.randn(batch, context, kv_heads, head_dim, generator=gen).to(device, dtype)
    values = torch.randn(batch, context, kv_heads, head_dim, generator=gen).to(device, dtype)
    for b in range(batch):  # fill the paged cache with the same K/V
        for pos in range(context):
            k_cache[tables[b, pos // block_size], pos % block_size] = keys[b, pos]
            v_cache[tables[b, pos // block_size], pos % block_size] = values[b, pos]
    query = torch.randn(batch, heads * head_dim, generator=gen).to(device, dtype)
    new_k = keys[:, -1].reshape(batch, kv_heads * head_dim).contiguous()
    new_v = values[:, -1].reshape(batch, kv_heads * head_dim).contiguous()
    last = context - 1
    slot_mapping = (tables[:, last // block_size] * block_size + last % block_size).to(torch.int64)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping, query_lens=[1] * batch, query_start_loc=list(range(batch + 1)),
        context_lens=torch.full((batch,), context, dtype=torch.int64, device=device), block_tables=tables,
        num_cached_tokens=[context - 1] * batch, max_context_len=context,
    )
    attn = PagedAttention(heads, head_dim, kv_heads, head_dim**-0.5)
    contiguous_k = keys.permute(0, 2, 1, 3).contiguous()  # [B, Hkv, ctx, D]
    contiguous_v = values.permute(0, 2, 1, 3).contiguous()
    q4 = query.view(batch, heads, 1, head_dim)

    def paged():
        meta.decode_masks.clear()  # the per-step masks are built once per step, by the first layer
        with torch.inference_mode():
            return attn(query, new_k, new_v, (k_cache, v_cache), meta)

    def contiguous():
        with torch.inference_mode():
            return F.scaled_dot_product_attention(q4, contiguous_k, contiguous_v, enable_gqa=heads != kv_heads)

    diff = (paged().view(batch, heads, head_dim) - contiguous().view(batch, heads, head_dim)).abs().max().item()
    return bench(paged, repeats), bench(contiguous, repeats), diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048])
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--kv-heads", type=int, default=40)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    print(f"Figure 18a (real, {args.device}, {args.dtype}): decode attention, {args.heads} heads x {args.head_dim}")
    print(f"{'batch':>5} {'context':>7} {'paged ms':>9} {'contig ms':>9} {'slowdown':>9} {'max|diff|':>10}")
    rows = []
    for batch in args.batch:
        for context in args.context:
            paged, contiguous, diff = measure(batch, context, args.heads, args.kv_heads, args.head_dim,
                                              args.block_size, args.repeats, args.device, dtype)
            slowdown = paged / contiguous - 1
            rows.append({"batch": batch, "context": context, "paged_s": paged, "contiguous_s": contiguous,
                         "slowdown": slowdown, "max_abs_diff": diff})
            print(f"{batch:>5} {context:>7} {1e3 * paged:>9.3f} {1e3 * contiguous:>9.3f} {100 * slowdown:>8.1f}% "
                  f"{diff:>10.2e}")
    worst = max(r["slowdown"] for r in rows)
    print(f"worst slowdown of the paged kernel: {100 * worst:.1f}% (paper: 20-26%; bar: <= 26%)")
    write_json("paper_fig18a_kernel", {"device": args.device, "dtype": args.dtype, "rows": rows,
                                       "worst_slowdown": worst})
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for batch in args.batch:
            sel = [r for r in rows if r["batch"] == batch]
            ax.plot([r["context"] for r in sel], [1e3 * r["paged_s"] for r in sel], marker="o",
                    label=f"paged, bs {batch}")
            ax.plot([r["context"] for r in sel], [1e3 * r["contiguous_s"] for r in sel], marker="x", linestyle="--",
                    label=f"contiguous, bs {batch}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length")
        ax.set_ylabel("ms per decode attention")
        ax.set_title(f"Figure 18a (real, {args.device})", fontsize=9)
        ax.legend(fontsize=7)
        save_png(fig, "paper_fig18a_kernel")


if __name__ == "__main__":
    main()
