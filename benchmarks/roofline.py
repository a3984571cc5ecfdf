"""The compute roofline of this machine for a model and a workload (issue 7: know the distance).

Roofline output tokens/s = output tokens / (the workload's FLOPs / measured matmul FLOP/s).
The workload's FLOPs count every linear layer (2 FLOPs per weight per token, LM head included:
prompt tokens skip it except the last one, as the engine computes logits only there) and
attention's two products over the context (2 x 2 x query heads x head_dim per cached token). The
matmul rate is measured here at the thread count the engine uses, on a GEMM the size of a
batch-256 step's MLP, the best of torch's F.linear and the oneDNN path the engine takes. It is
a ceiling, not a promise: decode at small batch is bound by memory bandwidth long before compute.

    .venv/bin/python benchmarks/roofline.py --dtype float32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def measure_matmul_flops(dtype: torch.dtype = torch.float32, m: int = 256, k: int = 576, n: int = 1536,
                         repeats: int = 7) -> float:
    """Best median FLOP/s of ``x[m, k] @ W[n, k].T`` (k, n: SmolLM2's MLP) at the current thread count.

    Best of torch's F.linear and the oneDNN reordered-weight path the engine uses on CPUs
    (pagedllm.models.cpu_gemm), whichever is faster for this dtype here.
    """
    from pagedllm.models.cpu_gemm import cpu_gemm_enabled, reorder_weight

    x = torch.randn(m, k).to(dtype)
    weight = torch.randn(n, k).to(dtype)
    candidates = [lambda: torch.nn.functional.linear(x, weight)]
    if cpu_gemm_enabled(torch.device("cpu"), dtype):
        packed = reorder_weight(weight)
        candidates.append(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    best = 0.0
    for gemm in candidates:
        start = time.perf_counter()
        gemm()
        once = max(time.perf_counter() - start, 1e-6)
        inner = max(1, min(1000, int(0.2 / once)))  # ~0.2 s per timing
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(inner):
                gemm()
            rates.append(2 * m * k * n * inner / (time.perf_counter() - start))
        best = max(best, statistics.median(rates))
    return best


def linear_params(hf_config) -> tuple[int, int]:
    """(weights of the linear layers of all decoder layers, weights of the LM head)."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    intermediate = getattr(hf_config, "intermediate_size", None) or 4 * hidden
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o and k, v
    gated = hf_config.model_type not in ("gpt2", "opt", "gpt_neox", "starcoder2")  # the others: gate, up, down
    mlp = (3 if gated else 2) * hidden * intermediate
    return hf_config.num_hidden_layers * (attention + mlp), hidden * hf_config.vocab_size


def workload_flops(hf_config, requests: list[tuple[int, int]]) -> float:
    """FLOPs to serve (prompt_len, output_len) requests: prefill, then one token per decode step."""
    layers_params, head_params = linear_params(hf_config)
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    attention_per_context_token = 4 * heads * head_dim * hf_config.num_hidden_layers
    total = 0.0
    for prompt_len, output_len in requests:
        # Prefill: every prompt token through the layers, causal attention (~half of prompt^2).
        total += 2 * layers_params * prompt_len + 2 * head_params
        total += attention_per_context_token * prompt_len * (prompt_len + 1) / 2
        # Decode: the first output token came from the prefill's logits; each later one is a step.
        for step in range(1, output_len):
            total += 2 * (layers_params + head_params) + attention_per_context_token * (prompt_len + step)
    return total


def roofline_tok_per_s(hf_config, requests: list[tuple[int, int]], flop_rate: float) -> float:
    return sum(out for _, out in requests) * flop_rate / workload_flops(hf_config, requests)


def report(hf_config, requests: list[tuple[int, int]], dtype: torch.dtype, measured: dict[str, float]) -> dict:
    """Print the roofline next to measured output tok/s per engine; return the figures."""
    rate = measure_matmul_flops(dtype)
    ceiling = roofline_tok_per_s(hf_config, requests, rate)
    print(f"compute roofline ({dtype}, {torch.get_num_threads()} threads): matmul {rate / 1e9:.1f} GFLOP/s x "
          f"{workload_flops(hf_config, requests) / 1e9:.1f} GFLOP for the workload -> {ceiling:.1f} output tok/s")
    for name, value in measured.items():
        print(f"  {name:28s} {value:8.1f} tok/s = {100 * value / ceiling:5.1f}% of the roofline")
    return {"matmul_flop_per_s": rate, "roofline_tok_per_s": ceiling}


def main() -> None:
    from pagedllm.models.loader import load_model_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or GGUF (default: embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=136)
    parser.add_argument("--output-len", type=int, default=136)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    config = load_model_config(args.model, args.dtype, None).hf_config
    report(config, [(args.prompt_len, args.output_len)], getattr(torch, args.dtype), {})


if __name__ == "__main__":
    main()
