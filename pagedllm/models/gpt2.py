"""GPT-2: learned absolute positions, pre-LayerNorm blocks, gelu_new MLP, lm_head tied to wte.

HF stores GPT-2's projections as ``Conv1D`` (weight ``[in, out]``); we use ``nn.Linear`` and
transpose those weights on load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.attention import AttentionMetadata
from pagedllm.layers.norms_and_activations import get_activation
from pagedllm.layers.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.mha import MultiHeadAttention

_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")
# HF's attention names -> the shared attention's (HF stores q, k, v stacked in one c_attn tensor;
# the fused layer splits it per part, then per rank).
_ATTENTION_NAMES = ((".attn.c_attn.", ".attn.qkv_proj."), (".attn.c_proj.", ".attn.out_proj."))


def gpt2_attention(config: Any, layer_idx: int) -> MultiHeadAttention:
    head_dim = config.hidden_size // config.num_attention_heads
    scale = head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        scale /= float(layer_idx + 1)
    return MultiHeadAttention(config.hidden_size, config.num_attention_heads, bias=True, scale=scale)


class GPT2MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        inner = getattr(config, "n_inner", None) or 4 * hidden
        self.c_fc = ColumnParallelLinear(hidden, inner, bias=True)
        self.c_proj = RowParallelLinear(inner, hidden, bias=True)
        self.act = get_activation(getattr(config, "activation_function", "gelu_new"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = gpt2_attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(
        self, hidden: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor] | None, meta: AttentionMetadata | None
    ) -> torch.Tensor:
        h = self.attn(self.ln_1(hidden), kv_cache, meta)
        h += hidden
        out = self.mlp(self.ln_2(h))
        out += h
        return out


class GPT2Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)
        for i, block in enumerate(self.h):
            hidden = block(hidden, kv_caches[i] if kv_caches is not None else None, attn_metadata)
        return self.ln_f(hidden)


class GPT2LMHeadModel(CausalLM):
    def __init__(self, hf_config: Any) -> None:
        super().__init__(hf_config, tie_default=True)
        if getattr(hf_config, "add_cross_attention", False):
            raise ValueError("GPT-2 with cross-attention is not supported.")
        self.transformer = GPT2Model(hf_config)
        self.add_lm_head(hf_config.hidden_size)

    def backbone(self) -> nn.Module:
        return self.transformer

    def embedding(self) -> VocabParallelEmbedding:
        return self.transformer.wte

    def map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """HF names with or without the ``transformer.`` prefix; Conv1D weights are transposed."""
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return None  # causal-mask buffers of old checkpoints
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name
        if name.endswith(_CONV1D):
            tensor = tensor.t()
        for old, new in _ATTENTION_NAMES:
            name = name.replace(old, new)
        return name, tensor
