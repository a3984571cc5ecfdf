"""How far 4-bit KV layouts are from int8's accuracy: quantization error on the default model's real K/V.

One prompt of --tokens tokens (benchmarks/data/kv_eval_prose.txt) runs through the default model
with a float32 cache; the pool's keys and values are then read back and, as the int4 cache stores
them (keys less each layer's mean key, both rotated by the cache's Walsh-Hadamard transform),
quantized by candidate 4-bit rules. Printed: the relative squared error ||x - q(x)||^2 / ||x||^2
of each rule, for K and V, beside int8's rule for scale:

- ``minmax32``: the int4 cache's rule (groups of 32, x = d * q + m from the group's min and max; 40
  bytes a 64-wide row);
- ``mse32``: the same layout with each group's range shrunk from either end to the pair that
  minimises its squared error (a search over --steps x --steps candidates);
- ``minmax16`` / ``minmax8``: smaller groups (48 / 64 bytes a row);
- ``int8``: one symmetric scale per row (the int8 cache, 66 bytes).

    .venv/bin/python benchmarks/kv_int4_error.py
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.attention.kv_quant import hadamard, rotation_shifts  # noqa: E402

TEXT = os.path.join(HERE, "data", "kv_eval_prose.txt")


def minmax(groups: torch.Tensor, low: torch.Tensor | None = None, high: torch.Tensor | None = None) -> torch.Tensor:
    low = groups.amin(-1, keepdim=True) if low is None else low
    high = groups.amax(-1, keepdim=True) if high is None else high
    step = (high - low) / 15
    step = torch.where(step > 0, step, torch.ones_like(step))
    return ((groups - low) / step).round().clamp(0, 15) * step + low


def mse_search(steps: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def quantize(groups: torch.Tensor) -> torch.Tensor:
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        best = minmax(groups)
        error = ((best - groups) ** 2).sum(-1, keepdim=True)
        for i in range(steps):
            for j in range(steps):
                # Shrink the range by up to 20% of its width from each end independently.
                lo = low + (high - low) * 0.2 * j / steps
                hi = high - (high - low) * 0.2 * i / steps
                candidate = minmax(groups, lo, hi)
                candidate_error = ((candidate - groups) ** 2).sum(-1, keepdim=True)
                better = candidate_error < error
                best = torch.where(better, candidate, best)
                error = torch.where(better, candidate_error, error)
        return best

    return quantize


def int8_rows(rows: torch.Tensor) -> torch.Tensor:
    scale = rows.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (rows / scale).round().clamp(-127, 127) * scale


def relative_error(x: torch.Tensor, quantize: Callable[[torch.Tensor], torch.Tensor], group: int) -> float:
    groups = x.unflatten(-1, (x.shape[-1] // group, group))
    back = quantize(groups).flatten(-2)
    return float(((back - x) ** 2).sum() / (x**2).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    llm = LLM(dtype="float32", kv_cache_memory="64MiB", int8_activations=False)
    with open(TEXT) as f:
        ids = llm.llm_engine.tokenizer(f.read())["input_ids"][: args.tokens]
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    pool = llm.llm_engine.worker.cache_engine.gpu_pool  # [layers, 2, blocks, block_size, heads, D]
    layers, _, blocks, block_size, heads, head_dim = pool.shape
    rows = pool.reshape(layers, 2, blocks * block_size, heads, head_dim)
    written = rows[0, 0].abs().sum((-1, -2)) > 0  # the slots the prompt wrote
    states = rows[:, :, written].float()
    write_shift, _ = rotation_shifts(head_dim)
    print(f"{int(written.sum())} tokens, {layers} layers, {heads} KV heads of {head_dim}")
    print(f"{'':4} {'minmax32':>9} {'mse32':>9} {'minmax16':>9} {'minmax8':>9} {'int8':>9}")
    for name, index in (("K", 0), ("V", 1)):
        x = states[:, index]
        if index == 0:
            x = x - x[:, 1:].mean(1, keepdim=True)  # the cache's key offset: the mean key past position 0
        x = hadamard(x) * 2.0**-write_shift
        errors = [relative_error(x, minmax, 32), relative_error(x, mse_search(args.steps), 32),
                  relative_error(x, minmax, 16), relative_error(x, minmax, 8), relative_error(x, int8_rows, head_dim)]
        print(f"{name:4} " + " ".join(f"{e:9.5f}" for e in errors))


if __name__ == "__main__":
    main()
