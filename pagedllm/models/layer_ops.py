"""A decoder layer as one description of its ops, and the Python interpreter of that description.

Each decoder layer is described once, when it is built, by a ``LayerOps``: its wiring (norms
before each block, Gemma's sandwich, OLMo 2's norms after each block, the parallel block with one
or two input norms), its norm modules, its attention (the q/k/v and output linears, q/k norms and
where they apply, whether and with which table it rotates, the paged attention with its window,
soft cap and sinks), its MLP and its residual multiplier. ``run_layer`` runs a layer by reading its
description; the C++ layer loop runs an encoding of the same description
(``layer_program.layer_program``), so the two paths cannot disagree on what a layer does, and a
family is a new description, never a new forward.

The wiring and q/k-norm values are the loop's own codes (``kernels/codes.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.attention import AttentionMetadata, PagedAttention
from pagedllm.kernels.codes import (
    NO_QK_NORM,
    PARALLEL,
    PARALLEL_SHARED,
    POST_NORM,
    PRE_NORM,
    QK_HEAD,
    QK_HEADS,
    QK_PROJECTION,
    SANDWICH,
)
from pagedllm.models.rotary import rotate_heads

Rope = tuple[torch.Tensor, torch.Tensor]
KVCache = tuple[torch.Tensor, torch.Tensor]

WIRING_NAMES = {PRE_NORM: "pre-norm", SANDWICH: "sandwich", POST_NORM: "post-norm", PARALLEL: "parallel",
                PARALLEL_SHARED: "parallel, one input norm"}
# Where q/k norms apply, by the family setting's name (families.DecoderSettings.qk_norm).
QK_NORM_CODES = {None: NO_QK_NORM, "head": QK_HEAD, "heads": QK_HEADS, "projection": QK_PROJECTION}


@dataclass(eq=False, slots=True)
class AttentionOps:
    """qkv -> [q/k norms] -> [rope] -> paged attention -> o. ``qk_norm``: NO_QK_NORM, QK_HEAD (one
    weight over each head), QK_HEADS (a weight per head) or QK_PROJECTION (over the whole q or k
    projection, before it is cut into heads); ``rope_key`` None: the layer does not rotate."""

    qkv_proj: nn.Module
    o_proj: nn.Module
    attn: PagedAttention
    head_dim: int
    q_size: int
    kv_size: int
    qk_norm: int
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    rope_key: str | None
    rotates: bool

    @property
    def num_heads(self) -> int:
        return self.q_size // self.head_dim

    @property
    def num_kv_heads(self) -> int:
        return self.kv_size // self.head_dim


@dataclass(eq=False, slots=True)
class LayerOps:
    """One layer: ``wiring`` says which of the norms exist and how the residual flows (norms a
    wiring does not use are None); ``mlp`` is the gated or plain MLP or a mixture of experts;
    ``residual_scale`` (Granite) multiplies each block's output before its residual add."""

    wiring: int
    input_norm: nn.Module | None
    post_attention_norm: nn.Module | None
    pre_feedforward_norm: nn.Module | None
    post_feedforward_norm: nn.Module | None
    attention: AttentionOps
    mlp: nn.Module
    residual_scale: float | None


def run_attention(ops: AttentionOps, rope: Rope, hidden: torch.Tensor, kv_cache: KVCache | None,
                  meta: AttentionMetadata | None) -> torch.Tensor:
    num_tokens = hidden.shape[0]
    qkv = ops.qkv_proj(hidden)
    qk_size = ops.q_size + ops.kv_size
    if ops.qk_norm == NO_QK_NORM:
        qk = qkv[:, :qk_size]
        if ops.rotates:
            # Rotate q and k in one go: they are adjacent in the fused output.
            qk = rotate_heads(qk.view(num_tokens, -1, ops.head_dim), *rope).view(num_tokens, qk_size)
        q, k = qk.split([ops.q_size, ops.kv_size], dim=-1)
    else:
        q, k = qkv[:, :qk_size].split([ops.q_size, ops.kv_size], dim=-1)
        if ops.qk_norm == QK_PROJECTION:
            q, k = ops.q_norm(q), ops.k_norm(k)
        q, k = q.reshape(num_tokens, -1, ops.head_dim), k.reshape(num_tokens, -1, ops.head_dim)
        if ops.qk_norm != QK_PROJECTION:
            q, k = ops.q_norm(q), ops.k_norm(k)
        if ops.rotates:
            q, k = rotate_heads(q, *rope), rotate_heads(k, *rope)
    v = qkv[:, qk_size:]
    return ops.o_proj(ops.attn(q, k, v, kv_cache, meta))


def run_layer(ops: LayerOps, ropes: dict[str | None, Rope], hidden: torch.Tensor, residual: torch.Tensor | None,
              kv_cache: KVCache | None, meta: AttentionMetadata | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden, residual) -> the next layer's (hidden, residual), vLLM's form: the residual is carried
    beside the hidden state and each add is fused into the norm after it; the first layer gets
    residual None. Parallel and post-norm layers take and return a plain hidden state (residual None)."""
    rope = ropes[ops.attention.rope_key]
    wiring = ops.wiring
    if wiring == POST_NORM:
        hidden = hidden + ops.post_attention_norm(run_attention(ops.attention, rope, hidden, kv_cache, meta))
        return hidden + ops.post_feedforward_norm(ops.mlp(hidden)), None
    if wiring in (PARALLEL, PARALLEL_SHARED):
        normed = ops.input_norm(hidden)
        h = run_attention(ops.attention, rope, normed, kv_cache, meta)
        out = ops.mlp(normed if wiring == PARALLEL_SHARED else ops.post_attention_norm(hidden))
        out += h
        out += hidden
        return out, None
    if residual is None:
        residual = hidden
        hidden = ops.input_norm(hidden)
    else:
        hidden, residual = ops.input_norm(hidden, residual)
    h = run_attention(ops.attention, rope, hidden, kv_cache, meta)
    if wiring == SANDWICH:
        h, residual = ops.pre_feedforward_norm(ops.post_attention_norm(h), residual)
        return ops.post_feedforward_norm(ops.mlp(h)), residual
    if ops.residual_scale is not None:  # Granite: residual + block(x) * scale
        h *= ops.residual_scale
    h, residual = ops.post_attention_norm(h, residual)
    out = ops.mlp(h)
    if ops.residual_scale is not None:
        out *= ops.residual_scale
    return out, residual
