"""The key offset an integer KV cache (int8, int4) subtracts: each KV head's mean key, measured once
at start-up.

Keys carry a large per-channel bias that is the same for every token (a few channels sit far from
zero whatever the text), so a row's range, and with it every value's rounding step, is mostly that
bias. Attention does not see a constant subtracted from all of a head's keys: each query's logits
over its keys all move by ``q . offset``, which softmax cancels. So an integer cache stores
``k - offset`` and every attention path reads it as it is; nothing is added back. That holds for any
offset, so one measured once per model serves every sequence, and prefix-cached blocks stay valid
across requests. It does not hold under a logit soft cap (tanh is not shift-invariant) or with
per-head sink logits: those layers keep no offset. Float8 caches keep none either: a float value's
step follows its own magnitude, so the bias costs them nothing (on the default model, subtracting it
took fp8_e4m3's perplexity penalty from +0.38% to +0.71%).

The offset is the mean key over positions 1.. of a calibration pass of random token ids (the first
position is each sequence's attention sink, far from the rest). On the default model with an int4
cache it takes the perplexity penalty from +3.91% to +3.21% and top-1 agreement from 88.2% to 89.7%
(benchmarks/kv_cache_dtype.py --without-key-offset int4).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backend import PagedAttention

# Tokens of the calibration pass (fewer if the model's context is shorter); below 2 there are no keys
# after the first position, and no offset is set (benchmarks/kv_cache_dtype.py compares that way).
CALIBRATION_TOKENS = 128
CALIBRATION_SEED = 0


class KeyStatistics:
    """The running sum of the keys one attention layer computes in a calibration pass."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.count = 0

    def add(self, key: torch.Tensor) -> None:
        """Keys [T, Hkv, D] of one sequence from position 0; the first position is left out."""
        rows = key[1:].float()
        total = rows.sum(0)
        self.total = total if self.total is None else self.total + total
        self.count += rows.shape[0]

    def mean(self) -> torch.Tensor:
        if self.total is None or self.count == 0:
            raise RuntimeError("the calibration pass computed no keys")
        return (self.total / self.count).contiguous()


def offset_layers(model: nn.Module) -> list[PagedAttention]:
    """The attention layers whose softmax a key offset leaves unchanged."""
    return [m for m in model.modules()
            if isinstance(m, PagedAttention) and m.logits_soft_cap is None and m.sinks is None]


@torch.inference_mode()
def calibrate_key_offsets(model: nn.Module, vocab_size: int, device: torch.device, max_model_len: int,
                          seed: int = CALIBRATION_SEED) -> int:
    """Sets each offset layer's ``key_offset`` to its mean key over one pass of
    ``CALIBRATION_TOKENS`` seeded random token ids (the same ids on every rank and every run).
    Returns the number of layers set."""
    layers = offset_layers(model)
    num_tokens = min(CALIBRATION_TOKENS, max_model_len)
    if not layers or num_tokens < 2:
        return 0
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (num_tokens,), generator=generator).to(device)
    positions = torch.arange(num_tokens, dtype=torch.long, device=device)
    for layer in layers:
        layer.key_offset = None
        layer.key_statistics = KeyStatistics()
    try:
        model(input_ids, positions, None, None)  # no cache: attention within the pass itself
        for layer in layers:
            layer.key_offset = layer.key_statistics.mean()
    finally:
        for layer in layers:
            layer.key_statistics = None
    return len(layers)
