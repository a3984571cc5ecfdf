"""What ``-ffast-math`` would buy the CPU kernels: the active level built twice, with the kernels' flags
(``-O3 -fno-math-errno -fno-trapping-math``, IEEE infinities and NaN kept) and with ``-ffast-math``
(what they were built with before), the same kernels and the default model run side by side.

The kernels rely on infinities and NaN (-INFINITY sentinels, masked logits, NaN kept through bfloat16
rounding), which ``-ffinite-math-only`` (part of ``-ffast-math``) lets the compiler assume away; this
measures the price of keeping them. Each repeat runs every case under both builds, in alternating
order (ABBA), so drift on a shared machine falls on both; medians over the repeats, and the ratio
fast-math time / IEEE time (below 1: fast-math faster).

Cases: decode attention (the default model's heads: 9 query, 3 KV heads of 64, blocks of 16) in
float32 and bfloat16; chunked prefill attention (exp / the simd reductions: the compiler-vectorised
kernel); a Q4_0 quantized linear at 1 and 16 rows; gelu(gate) * up (libmvec's erf); greedy picking
over a vocabulary; and the default model's output tok/s decoding a few greedy streams.

    .venv/bin/python benchmarks/fast_math_cost.py [--repeats 5] [--streams 4] [--threads 2]

The second build takes one to three minutes on two cores the first time (torch's cache keeps it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_blocks import random_packed  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.kernels.attention import paged_chunked_attention, paged_decode_attention  # noqa: E402
from pagedllm.kernels.build import BASE_FLAGS, FAST_MATH_FLAGS, build_level  # noqa: E402
from pagedllm.kernels.codes import check_codes  # noqa: E402
from pagedllm.kernels.dispatch import active_isa, module_for, module_override  # noqa: E402


def median_seconds(fn: Callable[[], object], calls: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_cases(dtype: torch.dtype, batch: int, context: int) -> dict[str, Callable[[], object]]:
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    blocks = batch * -(-context // block_size)
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(blocks, generator=gen).view(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.long)
    scale = head_dim**-0.5
    query = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    # A prefill chunk of 64 new tokens per sequence over the rest of its context.
    chunk = 64
    chunk_query = torch.randn(batch * chunk, heads, head_dim, generator=gen).to(dtype)
    starts = torch.arange(0, batch * chunk + 1, chunk)
    name = str(dtype).removeprefix("torch.")
    return {
        f"decode attention {name} {batch}x{context}":
            lambda: paged_decode_attention(query, k_cache, v_cache, tables, lens, scale),
        f"chunked attention {name} {batch}x{chunk} new of {context}":
            lambda: paged_chunked_attention(chunk_query, k_cache, v_cache, tables, starts, lens, scale),
    }


def module_cases(module) -> dict[str, Callable[[], object]]:
    """Cases that call the module directly (its own build, whichever is active)."""
    from gguf.constants import GGMLQuantizationType

    rng = np.random.default_rng(0)
    qtype = GGMLQuantizationType.Q4_0
    n, k = 2048, 2048
    packed = torch.from_numpy(np.ascontiguousarray(random_packed(rng, qtype, n, k)))
    x1, x16 = torch.randn(1, k), torch.randn(16, k)
    gate_up = torch.randn(16, 2 * 1536)
    logits = torch.randn(8, 49152)
    return {
        "quant_linear Q4_0 2048x2048, 1 row": lambda: module.quant_linear(x1, packed, qtype.value, k, None, 48),
        "quant_linear Q4_0 2048x2048, 16 rows": lambda: module.quant_linear(x16, packed, qtype.value, k, None, 48),
        "gelu(gate) * up 16x1536": lambda: module.gelu_and_mul(gate_up),
        "greedy_pick 8x49152": lambda: module.greedy_pick(logits),
    }


def model_tok_s(llm: LLM, streams: int, tokens: int) -> tuple[float, list[list[int]]]:
    prompts = [{"prompt_token_ids": [100 + 37 * i + j for j in range(16)]} for i in range(streams)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    return sum(map(len, ids)) / elapsed, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="kernel calls per case and repeat (median)")
    parser.add_argument("--streams", type=int, default=4, help="greedy streams the default model decodes")
    parser.add_argument("--tokens", type=int, default=48, help="output tokens per stream")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-model", action="store_true", help="the kernels only")
    parser.add_argument("--other-flags", default=" ".join(FAST_MATH_FLAGS),
                        help="the flag set compared with the kernels' own (default: -ffast-math's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    level = active_isa()
    builds = {}
    for label, flags in (("ieee", BASE_FLAGS), ("fast-math", tuple(args.other_flags.split()))):
        start = time.perf_counter()
        module = module_for(level) if flags == BASE_FLAGS else build_level(level, base_flags=flags)
        if module is None:
            raise SystemExit(f"the {level} kernels did not build")
        check_codes(module)
        builds[label] = module
        print(f"{label:9s} build of {level} ({' '.join(flags)}): {time.perf_counter() - start:.0f} s to load")

    cases = {**attention_cases(torch.float32, 16, 500), **attention_cases(torch.bfloat16, 16, 500)}
    per_build = {label: module_cases(module) for label, module in builds.items()}
    llms: dict[str, LLM] = {}
    if not args.no_model:
        for label, module in builds.items():
            with module_override(level, module):
                # The default model (it keeps this build); a small pool each: two pools sized from
                # free memory would leave the second one's pages faulting in during the timings.
                llms[label] = LLM(num_threads=args.threads, kv_cache_memory="512MiB")
            model_tok_s(llms[label], args.streams, 8)  # warm-up
    times: dict[str, dict[str, list[float]]] = {}
    tokens: dict[str, list[list[int]]] = {}
    order = list(builds)
    for repeat in range(args.repeats):
        for label in order if repeat % 2 == 0 else order[::-1]:
            with module_override(level, builds[label]):
                for name, fn in {**cases, **per_build[label]}.items():
                    times.setdefault(name, {}).setdefault(label, []).append(median_seconds(fn, args.calls))
                if label in llms:
                    tok_s, tokens[label] = model_tok_s(llms[label], args.streams, args.tokens)
                    times.setdefault(f"default model, {args.streams} streams (tok/s)", {}).setdefault(
                        label, []).append(tok_s)
        print(f"repeat {repeat + 1}/{args.repeats} done")

    print(f"\nlevel {level}, {args.threads} threads, medians of {args.repeats} repeats "
          f"(kernels: median of {args.calls} calls each)")
    print(f"other flags: {args.other_flags}")
    print("| case | IEEE flags | other flags | other / IEEE |")
    print("|---|---:|---:|---:|")
    for name, by_label in times.items():
        ieee, fast = statistics.median(by_label["ieee"]), statistics.median(by_label["fast-math"])
        if name.endswith("(tok/s)"):
            print(f"| {name} | {ieee:.1f} tok/s | {fast:.1f} tok/s | {ieee / fast:.3f} (time) |")
        else:
            print(f"| {name} | {ieee * 1e6:.0f} us | {fast * 1e6:.0f} us | {fast / ieee:.3f} |")
    if len(tokens) == 2:
        same = sum(a == b for a, b in zip(tokens["ieee"], tokens["fast-math"], strict=True))
        print(f"greedy streams identical under both builds: {same}/{len(tokens['ieee'])}")


if __name__ == "__main__":
    main()
