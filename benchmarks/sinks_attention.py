"""Attention with sinks (GPT-OSS) per layer on a CPU: the C++ kernels against the torch path.

A GPT-OSS-20B-shaped attention layer (64 query heads, 8 KV heads of 64, a sink logit per head,
blocks of 16) through ``PagedAttention`` as the model calls it (the step's keys and values written
into the cache, then attention), with the C++ kernels on and off:

- decodes: ``--batches`` sequences of ``--context`` tokens; the torch path as it runs by default
  (batch invariance: one sequence at a time over its own context) and over the whole batch padded
  to its longest (``batch_invariant=False``), against the decode kernel. Each call reads other
  blocks of a pool of ``--pool-mib`` than the call before (otherwise a large L3 keeps the context);
- prompts of ``--prompts`` tokens (nothing cached): the AMX tile kernel (bfloat16 on a CPU with AMX)
  and the chunked kernel, which the backend chooses between for a sinks layer (torch's fused SDPA
  takes no sinks), and the torch path's explicit softmax up to ``--torch-prompt-max`` tokens (its
  scores take heads x tokens^2 float32 values: 1 GiB at 2,048).

Medians over rounds, in ms per layer call.

    .venv/bin/python benchmarks/sinks_attention.py
    .venv/bin/python benchmarks/sinks_attention.py --dtypes bfloat16 --batches 1 16 --context 2048 --prompts 512
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from pagedllm.attention import AttentionMetadata, PagedAttention
from pagedllm.kernels import cpu_kernels, use_kernel_config
from pagedllm.kernels.attention import paged_chunked_attention, prompt_attention_amx, prompt_attention_amx_supported
from pagedllm.worker.cache_engine import zeroed_kv_pool


def sinks_layer(args: argparse.Namespace) -> PagedAttention:
    attn = PagedAttention(args.heads, args.head_dim, args.kv_heads, args.head_dim ** -0.5, sinks=True)
    attn.sinks.copy_(torch.randn(args.heads, generator=torch.Generator().manual_seed(0)) * 2)
    return attn


def step_metadata(tables: torch.Tensor, cached: int, new: int, block_size: int) -> AttentionMetadata:
    """Every sequence of ``tables`` computing ``new`` tokens after ``cached``."""
    batch = tables.shape[0]
    positions = torch.arange(cached, cached + new)
    slots = (tables[:, positions // block_size] * block_size + positions % block_size).reshape(-1)
    return AttentionMetadata(
        slot_mapping=slots,
        query_lens=[new] * batch,
        query_start_loc=[i * new for i in range(batch + 1)],
        context_lens=torch.full((batch,), cached + new, dtype=torch.long),
        block_tables=tables,
        num_cached_tokens=[cached] * batch,
        max_context_len=cached + new,
    )


def median_ms(run: Callable[[int], object], rounds: int) -> float:
    """Median of ``rounds`` timed calls ``run(i)`` after two untimed ones."""
    times = []
    for i in range(rounds + 2):
        start = time.perf_counter()
        run(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def layer_call(attn: PagedAttention, kv_cache, metas: list[AttentionMetadata], batch: int, new: int,
               dtype: torch.dtype, args: argparse.Namespace) -> Callable[[int], object]:
    tokens = batch * new
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(tokens, args.heads * args.head_dim, generator=gen).to(dtype)
    key = torch.randn(tokens, args.kv_heads * args.head_dim, generator=gen).to(dtype)
    value = torch.randn(tokens, args.kv_heads * args.head_dim, generator=gen).to(dtype)
    return lambda i: attn(query, key, value, kv_cache, metas[i % len(metas)])


def pool(blocks: int, dtype: torch.dtype, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (blocks, args.block_size, args.kv_heads, args.head_dim)
    cpu = torch.device("cpu")
    return zeroed_kv_pool(shape, dtype, cpu).normal_(), zeroed_kv_pool(shape, dtype, cpu).normal_()


def time_decodes(attn: PagedAttention, batch: int, dtype: torch.dtype, args: argparse.Namespace) -> dict[str, float]:
    per_seq = -(-args.context // args.block_size)
    row_bytes = 2 * args.block_size * args.kv_heads * args.head_dim * dtype.itemsize
    blocks = max(batch * per_seq, args.pool_mib * 2**20 // row_bytes)
    kv_cache = pool(blocks, dtype, args)
    order = torch.randperm(blocks)
    sets = blocks // (batch * per_seq)  # disjoint block sets, used in turn
    metas = [step_metadata(order[i * batch * per_seq:(i + 1) * batch * per_seq].view(batch, per_seq),
                           args.context - 1, 1, args.block_size) for i in range(sets)]
    run = layer_call(attn, kv_cache, metas, batch, 1, dtype, args)
    figures = {}
    for name, kernel, invariant in (("torch, one sequence at a time", False, True),
                                    ("torch, one padded batch", False, False), ("C++ decode kernel", True, True)):
        attn.use_cpu_kernel = kernel
        with use_kernel_config(batch_invariant=invariant):
            figures[name] = median_ms(run, args.rounds)
    return figures


def time_prompt(attn: PagedAttention, length: int, dtype: torch.dtype, args: argparse.Namespace) -> dict[str, float]:
    """A prompt with nothing cached: the tile and chunked kernels called directly over the written
    cache, the torch path through the layer (its cache write is a small part of its time)."""
    per_seq = -(-length // args.block_size)
    k_cache, v_cache = pool(per_seq, dtype, args)
    meta = step_metadata(torch.randperm(per_seq).unsqueeze(0), 0, length, args.block_size)
    run = layer_call(attn, (k_cache, v_cache), [meta], 1, length, dtype, args)
    query = torch.randn(length, args.heads, args.head_dim).to(dtype)
    kernel_args = (query, k_cache, v_cache, meta.block_tables, meta.query_start_loc_tensor, meta.context_lens,
                   attn.scale)
    rounds = max(3, args.rounds // 5)
    figures = {}
    if prompt_attention_amx_supported(query, k_cache):
        figures["AMX tile kernel"] = median_ms(lambda i: prompt_attention_amx(*kernel_args, attn.sink_logits), rounds)
    figures["chunked kernel"] = median_ms(
        lambda i: paged_chunked_attention(*kernel_args, 0, 0.0, attn.sink_logits), rounds)
    if length <= args.torch_prompt_max:
        attn.use_cpu_kernel = False
        figures["torch explicit softmax"] = median_ms(run, rounds)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prompts", nargs="*", type=int, default=[512, 2048])
    parser.add_argument("--torch-prompt-max", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pool-mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if cpu_kernels() is None:
        raise SystemExit("the CPU kernels are not built here")
    torch.set_num_threads(args.threads)
    attn = sinks_layer(args)
    print(f"{args.heads} heads, {args.kv_heads} KV heads of {args.head_dim}, sinks; {args.threads} threads, "
          f"kernels {cpu_kernels().ISA}; ms per layer call (median)")
    with torch.inference_mode():
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for batch in args.batches:
                figures = time_decodes(attn, batch, dtype, args)
                base = figures["torch, one sequence at a time"]
                for name, ms in figures.items():
                    print(f"{dtype_name:9s} decode {batch:3d} x {args.context:5d}  {name:31s} {ms:9.2f} ms"
                          f"  {base / ms:6.1f}x")
            for length in args.prompts:
                figures = time_prompt(attn, length, dtype, args)
                for name, ms in figures.items():
                    print(f"{dtype_name:9s} prompt {length:5d}        {name:31s} {ms:9.2f} ms")


if __name__ == "__main__":
    main()
