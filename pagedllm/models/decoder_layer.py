"""One layer of the decoder: attention (with its optional q/k norms, rope and sinks) and the MLP or
mixture of experts, wired as the family's DecoderSettings say (pre- or post-norm, sandwich,
parallel residual, multipliers). The decoder stacks these; the C++ layer loop reads them.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention import AttentionMetadata, PagedAttention
from pagedllm.layers.norms_and_activations import HeadLayerNorm, get_activation, make_norm
from pagedllm.layers.parallel_layers import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedllm.models.families import DecoderSettings
from pagedllm.models.moe import GatedMLP, SparseMoE
from pagedllm.models.rotary import rotate_heads

Rope = tuple[torch.Tensor, torch.Tensor]
KVCache = tuple[torch.Tensor, torch.Tensor]


class DecoderAttention(nn.Module):
    def __init__(self, s: DecoderSettings, layer: int) -> None:
        super().__init__()
        self.head_dim = s.head_dim
        # Under tensor parallelism this rank computes only its heads (and their KV heads).
        self.qkv_proj = QKVParallelLinear(s.hidden_size, s.head_dim, s.num_heads, s.num_kv_heads, bias=s.qkv_bias)
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.q_size = self.num_heads * s.head_dim
        self.kv_size = self.num_kv_heads * s.head_dim
        self.o_proj = RowParallelLinear(s.num_heads * s.head_dim, s.hidden_size, bias=s.o_bias)
        self.q_norm, self.k_norm = _qk_norms(s, self.qkv_proj)
        self.norm_projection = s.qk_norm == "projection"  # OLMo 2: q (k) normed as a whole, before the heads
        self.use_rope = s.layer_rope[layer]
        self.attn = PagedAttention(
            self.num_heads, s.head_dim, self.num_kv_heads, scale=s.attn_scale,
            sliding_window=s.layer_windows[layer], logits_soft_cap=s.attn_softcap,
            sinks=s.family.attention_sinks,
        )

    def forward(self, rope: Rope, hidden: torch.Tensor, kv_cache: KVCache | None,
                meta: AttentionMetadata | None) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        qk_size = self.q_size + self.kv_size
        if self.q_norm is None:
            qk = qkv[:, :qk_size]
            if self.use_rope:
                # Rotate q and k in one go: they are adjacent in the fused output.
                qk = rotate_heads(qk.view(num_tokens, -1, self.head_dim), *rope).view(num_tokens, qk_size)
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
        else:
            q, k = qkv[:, :qk_size].split([self.q_size, self.kv_size], dim=-1)
            if self.norm_projection:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = q.reshape(num_tokens, -1, self.head_dim), k.reshape(num_tokens, -1, self.head_dim)
            if not self.norm_projection:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.use_rope:
                q, k = rotate_heads(q, *rope), rotate_heads(k, *rope)
        v = qkv[:, qk_size:]
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


def _qk_norms(s: DecoderSettings, qkv: QKVParallelLinear) -> tuple[nn.Module | None, nn.Module | None]:
    """The q and k norms of the shape the settings name (None, None: no q/k norms)."""
    if s.qk_norm is None:
        return None, None
    if s.qk_norm != "head" and qkv.tp_size > 1:
        # Their weights (and OLMo 2's statistics) span the heads that tensor parallelism splits.
        raise ValueError(f"{s.family.architectures[0]}'s q/k norms (over {s.qk_norm!r}) are not supported with "
                         "tensor parallelism.")
    heads = (qkv.num_local_heads, qkv.num_local_kv_heads)
    if s.qk_norm == "head":
        q_norm, k_norm = (make_norm(s.qk_norm_kind, s.head_dim, s.norm_eps) for _ in heads)
    elif s.qk_norm == "projection":
        q_norm, k_norm = (make_norm(s.qk_norm_kind, n * s.head_dim, s.norm_eps) for n in heads)
    elif s.qk_norm == "heads" and s.qk_norm_kind == "layer_nobias":
        q_norm, k_norm = (HeadLayerNorm(n, s.head_dim, s.norm_eps) for n in heads)
    else:
        raise ValueError(f"q/k norms of kind {s.qk_norm_kind!r} over {s.qk_norm!r} are not implemented.")
    return q_norm, k_norm


class PlainMLP(nn.Module):
    """c_proj(act(c_fc(x))) (GPT-NeoX, StarCoder2; names apart from the gated MLP's up_proj,
    which checkpoint loading fuses with gate_proj)."""

    def __init__(self, s: DecoderSettings) -> None:
        super().__init__()
        self.c_fc = ColumnParallelLinear(s.hidden_size, s.intermediate_size, bias=s.mlp_bias)
        self.c_proj = RowParallelLinear(s.intermediate_size, s.hidden_size, bias=s.mlp_bias)
        self.activation = s.activation
        self.act = get_activation(s.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class DecoderLayer(nn.Module):
    def __init__(self, s: DecoderSettings, layer: int) -> None:
        super().__init__()
        norm, hidden, eps = s.family.norm, s.hidden_size, s.norm_eps
        self.rope_key = s.layer_rope_keys[layer]
        self.parallel_residual = s.parallel_residual
        self.shared_input_norm = s.shared_input_norm
        self.post_norms = s.norm_placement == "post"
        self.residual_scale = s.residual_scale
        self.self_attn = DecoderAttention(s, layer)
        if s.moe_layers[layer]:
            self.mlp: nn.Module = SparseMoE(s)
        elif s.family.gated_mlp:
            self.mlp = GatedMLP(s, s.intermediate_size, bias=s.mlp_bias)
        else:
            self.mlp = PlainMLP(s)
        # Only the norms the checkpoint has: loading refuses a model parameter it does not fill.
        if not self.post_norms:
            self.input_layernorm = make_norm(norm, hidden, eps)
        if not self.shared_input_norm:
            self.post_attention_layernorm = make_norm(norm, hidden, eps)
        self.sandwich = s.family.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(norm, hidden, eps)
        if self.sandwich or self.post_norms:
            self.post_feedforward_layernorm = make_norm(norm, hidden, eps)

    def forward(self, ropes: dict[str | None, Rope], hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache | None, meta: AttentionMetadata | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, residual) -> the next layer's (hidden, residual), vLLM's form: the residual is
        carried beside the hidden state and each add is fused into the norm after it; the first
        layer gets residual None. Parallel-residual and post-norm layers take and return a plain
        hidden state (residual None)."""
        rope = ropes[self.rope_key]
        if self.post_norms:
            hidden = hidden + self.post_attention_layernorm(self.self_attn(rope, hidden, kv_cache, meta))
            return hidden + self.post_feedforward_layernorm(self.mlp(hidden)), None
        if self.parallel_residual:
            normed = self.input_layernorm(hidden)
            h = self.self_attn(rope, normed, kv_cache, meta)
            out = self.mlp(normed if self.shared_input_norm else self.post_attention_layernorm(hidden))
            out += h
            out += hidden
            return out, None
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        h = self.self_attn(rope, hidden, kv_cache, meta)
        if self.sandwich:
            h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        if self.residual_scale is not None:  # Granite: residual + block(x) * scale
            h *= self.residual_scale
        h, residual = self.post_attention_layernorm(h, residual)
        out = self.mlp(h)
        if self.residual_scale is not None:
            out *= self.residual_scale
        return out, residual
