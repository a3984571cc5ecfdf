"""OPT: learned positions (offset 2), LayerNorm before or after each block, ReLU MLP, tied lm_head.

When ``word_embed_proj_dim != hidden_size`` (OPT-350m) embeddings are projected in and the final
hidden states projected out, so ``forward`` returns ``[T, word_embed_proj_dim]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.attention import AttentionMetadata
from pagedllm.layers.cpu_gemm import PackableLinear
from pagedllm.layers.norms_and_activations import get_activation
from pagedllm.layers.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.mha import MultiHeadAttention

# OPT's position table has 2 extra rows in front (a fairseq legacy): position p is row p + 2.
POSITION_OFFSET = 2


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        bias = bool(getattr(config, "enable_bias", True))
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        self.do_layer_norm_before = bool(config.do_layer_norm_before)
        self.self_attn = MultiHeadAttention(hidden, config.num_attention_heads, bias=bias,
                                            scale=(hidden // config.num_attention_heads) ** -0.5)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(hidden, config.ffn_dim, bias=bias)
        self.fc2 = RowParallelLinear(config.ffn_dim, hidden, bias=bias)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.act = get_activation(config.activation_function)

    def forward(
        self, hidden: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor] | None, meta: AttentionMetadata | None
    ) -> torch.Tensor:
        pre = self.do_layer_norm_before
        h = self.self_attn(self.self_attn_layer_norm(hidden) if pre else hidden, kv_cache, meta)
        h += hidden
        if not pre:
            h = self.self_attn_layer_norm(h)
        out = self.fc2(self.act(self.fc1(self.final_layer_norm(h) if pre else h)))
        out += h
        if not pre:
            out = self.final_layer_norm(out)
        return out


class OPTDecoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        proj_dim = getattr(config, "word_embed_proj_dim", None) or hidden
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, proj_dim)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, hidden)
        self.project_in = PackableLinear(proj_dim, hidden, bias=False) if proj_dim != hidden else None
        self.project_out = PackableLinear(hidden, proj_dim, bias=False) if proj_dim != hidden else None
        keep_final_norm = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine) if keep_final_norm else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions + POSITION_OFFSET)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, kv_caches[i] if kv_caches is not None else None, attn_metadata)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden


class OPTModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(CausalLM):
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
    }

    def __init__(self, hf_config: Any) -> None:
        super().__init__(hf_config, tie_default=True)
        self.model = OPTModel(hf_config)
        self.add_lm_head(getattr(hf_config, "word_embed_proj_dim", None) or hf_config.hidden_size)

    def backbone(self) -> nn.Module:
        return self.model.decoder

    def embedding(self) -> VocabParallelEmbedding:
        return self.model.decoder.embed_tokens

    def map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """HF names (``model.decoder.*``), or the original ``decoder.*``."""
        return ("model." + name if name.startswith("decoder.") else name), tensor
