"""The GEMM roofline of a workload on this machine: how fast its linear layers alone could run.

The ceiling is built from the workload's own GEMM shapes, not from one large GEMM. An ideal
engine serves the requests in the fewest, fullest steps: every prompt prefilled in chunks of
``prefill_rows`` tokens (the token budget of one step), then one decode step per output position
holding every request still generating (so the batch thins out as short requests finish, and the
tail steps are bound by reading the weights, not by arithmetic). Each step runs every projection
of every layer at its row count, and the LM head over the rows that sample (one per prompt after
prefill, one per request per decode step).

Every (rows, projection) shape is timed here, on the model's real number of weight copies (one per
layer, cycled as a forward pass does, so the weights stream from memory as they do in a serving
step instead of sitting in cache), by each available path: torch's F.linear (MKL), oneDNN with
weights reordered once, our panel kernel (pagedllm.layers.cpu_gemm); the fastest counts per shape.
Row counts between the timed ones are interpolated. Attention costs the larger of two bounds: its two
products at the best GEMM rate seen, and reading every cached key and value it attends once at
the machine's read bandwidth (benchmarks/bandwidth.py, measured here). The second is what decode
pays: each decode query reads its sequence's whole context, which for 64 float32 sequences of 300
tokens on the default model is ~0.9 GB per step, more than its weights. Norms, rope, sampling and
everything else count as free. The result is a ceiling: a measured engine above 100% of it means
the ceiling is wrong, and ``report`` says so instead of printing the figure.

    .venv/bin/python benchmarks/roofline.py --dtype float32   # default model, a 136 + 136 request
"""

from __future__ import annotations

import argparse
import bisect
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

TIMED_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass(frozen=True)
class ModelShapes:
    layers: int
    projections: tuple[tuple[str, int, int], ...]  # (name, in features, out features) of one layer
    head: tuple[int, int]  # LM head (hidden, vocab)
    attention_flops_per_context_token: int  # both products, all layers, one query token
    kv_values_per_token: int  # cached keys and values of one position, all layers


def model_shapes(hf_config) -> ModelShapes:
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    intermediate = getattr(hf_config, "intermediate_size", None) or 4 * hidden
    projections = [("qkv", hidden, (heads + 2 * kv_heads) * head_dim), ("o", heads * head_dim, hidden)]
    if hf_config.model_type in ("gpt2", "opt", "gpt_neox", "starcoder2", "phi"):  # plain MLP: up, down
        projections += [("up", hidden, intermediate), ("down", intermediate, hidden)]
    else:  # gated MLP: gate and up in one GEMM, then down
        projections += [("gate_up", hidden, 2 * intermediate), ("down", intermediate, hidden)]
    layers = hf_config.num_hidden_layers
    return ModelShapes(layers, tuple(projections), (hidden, hf_config.vocab_size), 4 * heads * head_dim * layers,
                       2 * kv_heads * head_dim * layers)


def ideal_schedule(requests: list[tuple[int, int]], prefill_rows: int,
                   prompts_cached: bool = False) -> tuple[Counter, Counter, int, int]:
    """(layer row counts -> steps, LM-head row counts -> steps, attended context tokens summed over queries,
    cached positions attention must read at least once: each prompt once, each decode query's context).

    ``prompts_cached``: every prompt is already in a prefix cache (a benchmark that repeats its
    requests): only each prompt's last token runs, to give the logits of the first output token."""
    layer_steps: Counter = Counter()
    head_steps: Counter = Counter()
    prompt_tokens = len(requests) if prompts_cached else sum(p for p, _ in requests)
    full, rest = divmod(prompt_tokens, prefill_rows)
    layer_steps[prefill_rows] += full
    if rest:
        layer_steps[rest] += 1
    head_steps[len(requests)] += 1  # each prompt's last position samples the first output token
    context = sum(p if prompts_cached else p * (p + 1) // 2 for p, _ in requests)
    kv_reads = sum(p for p, _ in requests)
    for step in range(1, max((o for _, o in requests), default=0)):
        rows = sum(1 for _, o in requests if o > step)
        layer_steps[rows] += 1
        head_steps[rows] += 1
        decode_context = sum(p + step + 1 for p, o in requests if o > step)
        context += decode_context
        kv_reads += decode_context
    return layer_steps, head_steps, context, kv_reads


def _gemm_paths(dtype: torch.dtype) -> dict[str, Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]]:
    """name -> (weight -> (x -> x @ weight.T)); each path prepares its weight once, as an engine would."""
    from pagedllm.layers.cpu_gemm import OneDNNWeight, PanelWeight, onednn_supported, panels_supported

    paths = {"F.linear": lambda w: (lambda x: torch.nn.functional.linear(x, w))}
    if onednn_supported(dtype):
        paths["oneDNN"] = lambda w: (lambda x, packed=OneDNNWeight(w): packed.linear(x, None))
    if panels_supported(dtype):
        paths["panels"] = lambda w: (lambda x, packed=PanelWeight(w): packed.linear(x, None))
    return paths


def time_shape(in_features: int, out_features: int, copies: int, rows: list[int], dtype: torch.dtype,
               repeats: int = 3) -> dict[int, tuple[float, str]]:
    """rows -> (best seconds per GEMM, path) for x[rows, in] @ W[out, in].T, cycling ``copies`` weights."""
    best: dict[int, tuple[float, str]] = {}
    for name, prepare in _gemm_paths(dtype).items():
        gemms = [prepare(torch.randn(out_features, in_features).to(dtype)) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, in_features).to(dtype)
            for gemm in gemms:  # warm-up pass (first calls allocate)
                gemm(x)
            passes = max(1, int(0.03 / max(_time_pass(gemms, x), 1e-6)))  # ~30 ms per timing
            seconds = min(_time_pass(gemms, x, passes) for _ in range(repeats)) / copies
            if m not in best or seconds < best[m][0]:
                best[m] = (seconds, name)
        del gemms
    return best


def _time_pass(gemms: list, x: torch.Tensor, passes: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(passes):
        for gemm in gemms:
            gemm(x)
    return (time.perf_counter() - start) / passes


def _interpolate(timed: dict[int, tuple[float, str]], m: int) -> float:
    points = sorted(timed)
    i = bisect.bisect_left(points, m)
    if i < len(points) and points[i] == m:
        return timed[m][0]
    if i == 0:
        return timed[points[0]][0]
    if i == len(points):  # past the largest timed: scale its per-row time
        return timed[points[-1]][0] * m / points[-1]
    lo, hi = points[i - 1], points[i]
    return timed[lo][0] + (timed[hi][0] - timed[lo][0]) * (m - lo) / (hi - lo)


def _timed_rows(needed: set[int]) -> list[int]:
    """The fixed grid up to the largest row count needed (and that one): interpolation brackets every count."""
    top = max(needed)
    return sorted({r for r in TIMED_ROWS if r < top} | {top})


def measure_roofline(hf_config, requests: list[tuple[int, int]], dtype: torch.dtype = torch.float32,
                     prefill_rows: int = 256, prompts_cached: bool = False) -> dict:
    """The workload's ceiling here (GEMMs, attention's products or KV reads); a dict of its figures (see ``report``)."""
    shapes = model_shapes(hf_config)
    from bandwidth import measure_read_bandwidth

    layer_steps, head_steps, context, kv_reads = ideal_schedule(requests, prefill_rows, prompts_cached)
    layer_seconds = 0.0
    paths: Counter = Counter()
    flops = best_rate = 0.0
    for _, k, n in shapes.projections:
        timed = time_shape(k, n, shapes.layers, _timed_rows(set(layer_steps)), dtype)
        paths.update(name for _, name in timed.values())
        layer_seconds += sum(steps * shapes.layers * _interpolate(timed, m) for m, steps in layer_steps.items())
        flops += sum(2 * m * k * n * shapes.layers * steps for m, steps in layer_steps.items())
        best_rate = max(best_rate, *(2 * m * k * n / t for m, (t, _) in timed.items()))
    k, n = shapes.head
    timed = time_shape(k, n, 2, _timed_rows(set(head_steps)), dtype)
    paths.update(name for _, name in timed.values())
    head_seconds = sum(steps * _interpolate(timed, m) for m, steps in head_steps.items())
    flops += sum(2 * m * k * n * steps for m, steps in head_steps.items())
    gemm_seconds = layer_seconds + head_seconds
    rate = flops / gemm_seconds
    best_rate = max(best_rate, *(2 * m * k * n / t for m, (t, _) in timed.items()))
    attention_flop_seconds = context * shapes.attention_flops_per_context_token / best_rate
    read_rate = measure_read_bandwidth(torch.get_num_threads())
    kv_read_seconds = kv_reads * shapes.kv_values_per_token * torch.finfo(dtype).bits / 8 / read_rate
    attention_seconds = max(attention_flop_seconds, kv_read_seconds)
    output_tokens = sum(o for _, o in requests)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "prompts_cached": prompts_cached,
        "layer_gemm_s": layer_seconds,
        "lm_head_s": head_seconds,
        "attention_s": attention_seconds,
        "attention_flop_s": attention_flop_seconds,
        "kv_read_s": kv_read_seconds,
        "read_bytes_per_s": read_rate,
        "gemm_flop_per_s": rate,
        "best_gemm_flop_per_s": best_rate,
        "fastest_path_counts": dict(paths),
        "roofline_tok_per_s": output_tokens / (gemm_seconds + attention_seconds),
        # The earlier ceiling, attention at the GEMM rate only (no KV reads): higher, for comparison.
        "gemm_only_tok_per_s": output_tokens / (gemm_seconds + attention_flop_seconds),
    }


def describe(figures: dict) -> str:
    cached = ", prompts prefix-cached" if figures["prompts_cached"] else ""
    return (f"roofline ({figures['dtype']}, {figures['threads']} threads{cached}): "
            f"layers {figures['layer_gemm_s']:.2f} s + LM head {figures['lm_head_s']:.2f} s at the workload's "
            f"shapes ({figures['gemm_flop_per_s'] / 1e9:.0f} GFLOP/s on average, best shape "
            f"{figures['best_gemm_flop_per_s'] / 1e9:.0f}; fastest path per shape: {figures['fastest_path_counts']}) "
            f"+ attention {figures['attention_s']:.2f} s (the larger of its products at the best rate, "
            f"{figures['attention_flop_s']:.2f} s, and reading the KV cache at "
            f"{figures['read_bytes_per_s'] / 1e9:.1f} GB/s, {figures['kv_read_s']:.2f} s) "
            f"-> {figures['roofline_tok_per_s']:.1f} output tok/s "
            f"(GEMMs and attention's products alone: {figures['gemm_only_tok_per_s']:.1f})")


def share_of_roofline(value: float, ceiling: float) -> str:
    """'NN.N% of the roofline', or a warning when a measured figure exceeds it (the roofline is then wrong)."""
    if value > ceiling:
        return (f"ABOVE the roofline ({value:.1f} > {ceiling:.1f} tok/s): the roofline is wrong "
                "(it missed a faster path or was measured on a busy machine)")
    return f"{100 * value / ceiling:5.1f}% of the roofline"


def report(figures: list[dict], measured: dict[str, float]) -> None:
    """Print one or more roofline measurements, then each engine against the highest of them."""
    for label, fig in zip(("before the engines", "after the engines", "again"), figures):
        print(f"{label}: {describe(fig)}")
    ceiling = max(f["roofline_tok_per_s"] for f in figures)
    gemm_only = max(f["gemm_only_tok_per_s"] for f in figures)
    for name, value in measured.items():
        print(f"  {name:28s} {value:8.1f} tok/s = {share_of_roofline(value, ceiling)} "
              f"({100 * value / gemm_only:.1f}% of GEMMs and attention's products alone)")


def main() -> None:
    from pagedllm.models.loader import load_model_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or GGUF (default: embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=136)
    parser.add_argument("--output-len", type=int, default=136)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prefill-rows", type=int, default=256)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--prompts-cached", action="store_true", help="prompts already in a prefix cache")
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    config = load_model_config(args.model, args.dtype, None).hf_config
    requests = [(args.prompt_len, args.output_len)] * args.num_requests
    print(describe(measure_roofline(config, requests, getattr(torch, args.dtype), args.prefill_rows,
                                    args.prompts_cached)))


if __name__ == "__main__":
    main()
