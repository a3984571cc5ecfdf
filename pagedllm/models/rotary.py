"""Rotary position embedding: every rope variant transformers defines, partial rotary included.

Frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` (linear, llama3, yarn, dynamic
NTK, longrope), so each variant is the checkpoint authors' definition. The cos/sin of the static
variants are precomputed per position. Two variants depend on the sequence's current length, as
in transformers: ``dynamic`` recomputes the base for lengths past ``max_position_embeddings`` and
``longrope`` switches from its short to its long factors past ``original_max_position_embeddings``.
Here that length is the sequence's length after this step (what transformers sees when it runs
one sequence), so the result does not depend on which other sequences share the batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.layers import fused_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
# Older config spellings of the same variants.
_ROPE_TYPE_ALIASES = {"su": "longrope", "mistral_yarn": "yarn"}


def _is_nested(params: Any) -> bool:
    """transformers 5 keeps one rope dict per layer type (Gemma 3: local and global bases)."""
    return isinstance(params, dict) and bool(params) and all(isinstance(v, dict) for v in params.values())


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope settings of a config (for one layer type where they differ per type), whether
    transformers 5 (``rope_parameters``) or 4 (``rope_theta`` + ``rope_scaling``) wrote it."""
    params = getattr(config, "rope_parameters", None)
    if _is_nested(params):
        if layer_type not in params:
            layer_type = "full_attention" if "full_attention" in params else next(iter(params))
        out = dict(params[layer_type])
    elif isinstance(params, dict) and params:
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
        out.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    out.setdefault("rope_theta", 10000.0)
    out.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    rope_type = out.get("rope_type") or out.get("type") or "default"
    out["rope_type"] = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    return out


def rope_layer_key(config: Any, layer_type: str | None) -> str | None:
    """The key under which a layer's rope settings live: its layer type when they are nested."""
    return layer_type if _is_nested(getattr(config, "rope_parameters", None)) else None


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_rope(config: Any, layer_type: str | None = None) -> None:
    """ValueError naming the rope variant when it is not one we implement."""
    params = rope_parameters(config, layer_type)
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope scaling type {params['rope_type']!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})."
        )
    rotary_dim = int(head_dim_of(config) * float(params["partial_rotary_factor"]))
    if rotary_dim < 2 or rotary_dim % 2:
        factor = params["partial_rotary_factor"]
        raise ValueError(f"partial_rotary_factor {factor} gives an odd rotary width {rotary_dim}.")


def max_positions(config: Any) -> int:
    """Positions the model may use: ``max_position_embeddings``, stretched for yarn and dynamic
    NTK as vLLM does (their configs keep the pre-training length there)."""
    limit = int(getattr(config, "max_position_embeddings", None) or 2048)
    params = rope_parameters(config)
    if params["rope_type"] == "yarn":
        original = int(params.get("original_max_position_embeddings") or limit)
        return max(limit, int(original * float(params["factor"])))
    if params["rope_type"] == "dynamic":
        return int(limit * float(params["factor"]))
    return limit


@contextlib.contextmanager
def _plain_cpu_tensors() -> Iterator[None]:
    """Rope tables are float32 on the CPU even while the model is built on the meta device in
    another default dtype."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(old)


def _inv_freq(config: Any, layer_key: str | None, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, cos/sin scaling) from transformers' definition of the variant."""
    params = rope_parameters(config, layer_key)
    rotary_dim = int(head_dim_of(config) * float(params["partial_rotary_factor"]))
    if params["rope_type"] == "default":
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
        return 1.0 / (float(params["rope_theta"]) ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {"layer_type": layer_key} if layer_key is not None else {}
    with _plain_cpu_tensors():
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu", seq_len=seq_len, **kwargs)
    return inv_freq.float(), float(scaling)


def _cos_sin_table(inv_freq: torch.Tensor, scaling: float, num_positions: int) -> torch.Tensor:
    with _plain_cpu_tensors():
        freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq)
        return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (HF's rotate_half) over the first ``rotary_dim`` channels.

    Tables are float32 and kept outside the parameters/buffers so that ``model.to(bfloat16)``
    does not round them; they follow the input's device on first use.
    """

    def __init__(self, config: Any, layer_key: str | None = None) -> None:
        super().__init__()
        check_rope(config, layer_key)
        self.config = config
        self.layer_key = layer_key
        params = rope_parameters(config, layer_key)
        self.rope_type = params["rope_type"]
        self.rotary_dim = int(head_dim_of(config) * float(params["partial_rotary_factor"]))
        inv_freq, scaling = _inv_freq(config, layer_key)
        # Lengths up to this use the table; longer ones (dynamic NTK) recompute their frequencies.
        self.table_len = int(getattr(config, "max_position_embeddings", None) or 2048)
        if self.rope_type != "dynamic":
            self.table_len = max_positions(config)
        self.cos_sin_cache = _cos_sin_table(inv_freq, scaling, self.table_len)
        self.long_cache: torch.Tensor | None = None
        self.switch_len = 0
        if self.rope_type == "longrope":
            # Short factors up to the pre-training length; any longer sequence uses the long ones.
            self.switch_len = int(params["original_max_position_embeddings"])
            long_freq, long_scaling = _inv_freq(config, layer_key, seq_len=self.switch_len + 1)
            self.long_cache = _cos_sin_table(long_freq, long_scaling, self.table_len)

    @property
    def depends_on_length(self) -> bool:
        return self.rope_type in ("dynamic", "longrope")

    def _move(self, device: torch.device) -> None:
        if self.cos_sin_cache.device != device:
            self.cos_sin_cache = self.cos_sin_cache.to(device)
            if self.long_cache is not None:
                self.long_cache = self.long_cache.to(device)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions, each [T, 1, rotary_dim // 2]; computed once per step.

        ``seq_lens[i]``: the length of token i's sequence after this step (dynamic and longrope only).
        """
        self._move(positions.device)
        if not self.depends_on_length or seq_lens is None:
            table = self.cos_sin_cache[positions]
        elif self.rope_type == "longrope":
            long = (seq_lens > self.switch_len).unsqueeze(1)
            table = torch.where(long, self.long_cache[positions], self.cos_sin_cache[positions])
        else:
            table = self._dynamic(positions, seq_lens)
        cos, sin = table.to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin

    def _dynamic(self, positions: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Dynamic NTK: a sequence longer than the table gets a larger base, computed for its length."""
        long = seq_lens > self.table_len
        if not bool(long.any()):
            return self.cos_sin_cache[positions]
        table = self.cos_sin_cache[positions.clamp(max=self.table_len - 1)]
        for length in torch.unique(seq_lens[long]).tolist():
            rows = (seq_lens == length).nonzero().squeeze(1)
            inv_freq, scaling = _inv_freq(self.config, self.layer_key, seq_len=int(length))
            freqs = positions[rows].float().unsqueeze(1) * inv_freq.to(positions.device)
            table[rows] = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)
        return table


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, n_heads, head_dim] -> rotated copy (HF's rotate_half convention); with partial rotary
    only the first ``2 * cos.shape[-1]`` channels turn, the rest pass through."""
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    half = rotary_dim // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)



def rotate_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary``, done in place on CPUs (one kernel over every head; x is then returned).
    The caller must not read x's old values afterwards."""
    if fused_ops.rotary_embedding_(x, cos, sin):
        return x
    return apply_rotary(x, cos, sin)
