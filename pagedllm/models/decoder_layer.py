"""One layer of the decoder: attention (with its optional q/k norms, rope and sinks) and the MLP or
mixture of experts, wired as the family's DecoderSettings say (pre- or post-norm, sandwich,
parallel residual, multipliers). Each layer builds its modules and its description
(models/layer_ops.py); the Python path and the C++ layer loop both run the description.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention import AttentionMetadata, PagedAttention
from pagedllm.kernels.codes import PARALLEL, PARALLEL_SHARED, POST_NORM, PRE_NORM, SANDWICH
from pagedllm.layers.norms_and_activations import HeadLayerNorm, get_activation, make_norm
from pagedllm.layers.parallel_layers import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedllm.models.families import DecoderSettings
from pagedllm.models.layer_ops import QK_NORM_CODES, AttentionOps, KVCache, LayerOps, Rope, run_attention, run_layer
from pagedllm.models.moe import GatedMLP, SparseMoE


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
        self.use_rope = s.layer_rope[layer]
        self.attn = PagedAttention(
            self.num_heads, s.head_dim, self.num_kv_heads, scale=s.attn_scale,
            sliding_window=s.layer_windows[layer], logits_soft_cap=s.attn_softcap,
            sinks=s.family.attention_sinks,
        )
        # What run_attention (and the C++ layer loop, through layer_program) runs.
        self.ops = AttentionOps(
            qkv_proj=self.qkv_proj, o_proj=self.o_proj, attn=self.attn, head_dim=s.head_dim, q_size=self.q_size,
            kv_size=self.kv_size, qk_norm=QK_NORM_CODES[s.qk_norm], q_norm=self.q_norm, k_norm=self.k_norm,
            rope_key=s.layer_rope_keys[layer], rotates=self.use_rope,
        )

    def forward(self, rope: Rope, hidden: torch.Tensor, kv_cache: KVCache | None,
                meta: AttentionMetadata | None) -> torch.Tensor:
        return run_attention(self.ops, rope, hidden, kv_cache, meta)


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
    """The modules of one layer and its description (``ops``, models/layer_ops.py), which both the
    Python path (``forward``) and the C++ layer loop run."""

    def __init__(self, s: DecoderSettings, layer: int) -> None:
        super().__init__()
        norm, hidden, eps = s.family.norm, s.hidden_size, s.norm_eps
        wiring = _wiring(s)
        self.self_attn = DecoderAttention(s, layer)
        if s.moe_layers[layer]:
            self.mlp: nn.Module = SparseMoE(s)
        elif s.family.gated_mlp:
            self.mlp = GatedMLP(s, s.intermediate_size, bias=s.mlp_bias)
        else:
            self.mlp = PlainMLP(s)
        # Only the norms the wiring uses (and the checkpoint has): loading refuses a model parameter
        # it does not fill.
        if wiring != POST_NORM:
            self.input_layernorm = make_norm(norm, hidden, eps)
        if wiring != PARALLEL_SHARED:
            self.post_attention_layernorm = make_norm(norm, hidden, eps)
        if wiring == SANDWICH:
            self.pre_feedforward_layernorm = make_norm(norm, hidden, eps)
        if wiring in (SANDWICH, POST_NORM):
            self.post_feedforward_layernorm = make_norm(norm, hidden, eps)
        self.ops = LayerOps(
            wiring=wiring,
            input_norm=getattr(self, "input_layernorm", None),
            post_attention_norm=getattr(self, "post_attention_layernorm", None),
            pre_feedforward_norm=getattr(self, "pre_feedforward_layernorm", None),
            post_feedforward_norm=getattr(self, "post_feedforward_layernorm", None),
            attention=self.self_attn.ops,
            mlp=self.mlp,
            residual_scale=s.residual_scale,
        )

    def forward(self, ropes: dict[str | None, Rope], hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache | None, meta: AttentionMetadata | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return run_layer(self.ops, ropes, hidden, residual, kv_cache, meta)


def _wiring(s: DecoderSettings) -> int:
    """The layer's wiring code from the family's settings."""
    if s.norm_placement == "post":
        return POST_NORM
    if s.parallel_residual:
        return PARALLEL_SHARED if s.shared_input_norm else PARALLEL
    return SANDWICH if s.family.sandwich_norms else PRE_NORM
