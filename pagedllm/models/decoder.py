"""The one decoder every Llama-like family runs on, configured by families.DecoderSettings.

Inputs are a flattened batch: ``input_ids[T]`` and ``positions[T]`` for every token computed this
step, all sequences concatenated without padding; the attention backend finds the sequence
boundaries in the metadata.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.attention import AttentionMetadata, PagedAttention
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.families import DecoderSettings, decoder_settings
from pagedllm.models.layer_stack import LayerStack, build_layer_stack, weights_key
from pagedllm.models.layers import HeadLayerNorm, get_activation, make_norm
from pagedllm.models.moe import GatedMLP, SparseMoE, split_fused_experts
from pagedllm.models.parallel_layers import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedllm.models.rotary import RotaryEmbedding, rotate_heads
from pagedllm.quantization.packed import PackedTensor

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


def token_seq_lens(positions: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
    """Per token: its sequence's length after this step (what length-dependent rope variants read)."""
    if meta is None:  # profiling run: one sequence
        return torch.full_like(positions, int(positions.max()) + 1)
    repeats = torch.tensor(meta.query_lens, device=positions.device)
    return torch.repeat_interleave(meta.context_lens.to(positions.device), repeats)


class DecoderModel(nn.Module):
    def __init__(self, s: DecoderSettings, hf_config: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s, i) for i in range(s.num_layers))
        self.norm = make_norm(s.family.norm, s.hidden_size, s.norm_eps)
        self.embed_scale = s.embed_scale
        # One rotary per distinct rope setting (Gemma 3: local and global); not submodules: no weights.
        self.rotary = {key: RotaryEmbedding(hf_config, key) for key in dict.fromkeys(s.layer_rope_keys)}
        self.rope_needs_lengths = any(r.depends_on_length for r in self.rotary.values())
        # The C++ loop over the layers (models/layer_stack.py), built for the weights named by the key.
        self._stack: LayerStack | None = None
        self._stack_key: int | None = -1

    def _layer_stack(self, hidden: torch.Tensor, kv_caches: list[KVCache] | None,
                     meta: AttentionMetadata | None) -> LayerStack | None:
        """The C++ loop over the layers when it serves this model on CPU (decided once per set of
        weights, packed or quantized); None for a step without a cache (profiling) or with autograd on."""
        if meta is None or kv_caches is None or hidden.device.type != "cpu" or torch.is_grad_enabled():
            return None
        key = weights_key(self)
        if self._stack_key != key:
            self._stack, self._stack_key = build_layer_stack(self), key
        return self._stack

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache] | None,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            # The scale rounded to the model dtype first, as the reference does.
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype, device=hidden.device)
        seq_lens = token_seq_lens(positions, attn_metadata) if self.rope_needs_lengths else None
        ropes = {key: rotary.cos_sin(positions, hidden.dtype, seq_lens) for key, rotary in self.rotary.items()}
        residual = None
        stack = self._layer_stack(hidden, kv_caches, attn_metadata)
        plan = None if stack is None else stack.plan(attn_metadata, hidden, kv_caches[0][0])
        if plan is not None:
            hidden, residual = stack.run(hidden, next(iter(ropes.values())), kv_caches, attn_metadata, plan)
        else:
            for i, layer in enumerate(self.layers):
                kv_cache = kv_caches[i] if kv_caches is not None else None
                hidden, residual = layer(ropes, hidden, residual, kv_cache, attn_metadata)
        if residual is None:
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


def _qkv_per_head_to_stacked(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """GPT-NeoX rows [h0: q k v, h1: q k v, ...] -> [q of all heads; k ...; v ...]."""
    rest = tensor.shape[1:]
    return tensor.reshape(num_heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def _rope_pairs_to_halves(rotary_dim: int, head_dim: int) -> torch.Tensor:
    """Channel order within a head that turns interleaved rope (pairs 2i, 2i + 1) into rope over halves
    (i, i + rotary_dim / 2): q and k reordered alike keep their dot products."""
    # On the CPU even while the model is built on the meta device: it indexes the checkpoint's tensors.
    with torch.device("cpu"):
        return torch.cat((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                          torch.arange(rotary_dim, head_dim)))


def _reorder_head_channels(tensor: torch.Tensor | PackedTensor, order: torch.Tensor,
                           rows: bool) -> torch.Tensor | PackedTensor:
    """``order`` applied within each head: to the rows of a projection (``rows``) or the last dim of a norm."""
    if not rows:
        return tensor[..., order]
    if isinstance(tensor, PackedTensor):  # GGUF rows: each row's blocks move whole
        data = tensor.data
        data = data.reshape(-1, len(order), data.shape[1])[:, order].reshape(data.shape)
        return dataclasses.replace(tensor, data=data)
    return tensor.reshape(-1, len(order), *tensor.shape[1:])[:, order].reshape(tensor.shape)


# StableLM's per-head q/k LayerNorms, one tensor per head; ours is one [heads, head_dim] weight.
_HEAD_NORM = re.compile(r"(.*\.[qk]_layernorm)\.norms\.(\d+)\.weight")


class DecoderForCausalLM(CausalLM):
    """Every family of families.FAMILIES (HF parameter names, mapped per family)."""

    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    @staticmethod
    def check_config(hf_config: Any) -> None:
        """ValueError for variants the decoder does not cover (rope scaling, activation, ...)."""
        decoder_settings(hf_config)

    def __init__(self, hf_config: Any) -> None:
        super().__init__(hf_config, tie_default=False)
        self.settings = decoder_settings(hf_config)
        self.model = DecoderModel(self.settings, hf_config)
        self.add_lm_head(self.settings.hidden_size, bias=self.settings.family.lm_head_bias)
        self.final_logit_softcapping = self.settings.final_softcap
        self.logit_scale = self.settings.logit_scale
        self._channel_order: torch.Tensor | None = None
        if self.settings.family.rope_interleaved:
            rotary_dim = next(iter(self.model.rotary.values())).rotary_dim
            self._channel_order = _rope_pairs_to_halves(rotary_dim, self.settings.head_dim)

    def backbone(self) -> nn.Module:
        return self.model

    def embedding(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        family = self.settings.family
        if "rotary_emb." in name or name.endswith((".attention.bias", ".attention.masked_bias")):
            return None  # rope tables and causal-mask buffers saved by some checkpoints
        # Only a transformers checkpoint stores q, k, v per head (GGUF files store them stacked).
        per_head = family.qkv_per_head and ".query_key_value." in name
        if name.startswith(family.prefix):
            name = "model." + name[len(family.prefix):]
        dotted = "." + name
        for old, new in family.renames:
            dotted = dotted.replace(old, new)
        name = dotted[1:]
        if not name.startswith(("model.", "lm_head.")):
            name = "model." + name  # checkpoints of the bare backbone
        if per_head:
            tensor = _qkv_per_head_to_stacked(tensor, self.settings.num_heads)
        if name.endswith(".self_attn.sinks"):
            # One logit per query head (GPT-OSS), held by the attention; a rank keeps its heads' own.
            qkv = self._qkv_of(name)
            tensor = tensor.narrow(0, qkv.tp_rank * qkv.num_local_heads, qkv.num_local_heads)
            return name.removesuffix("sinks") + "attn.sinks", tensor
        if self._channel_order is not None and ".self_attn." in name:
            kind = name.rsplit(".", 2)[-2]
            if kind in ("q_proj", "k_proj", "q_norm", "k_norm"):
                tensor = _reorder_head_channels(tensor, self._channel_order, rows=kind.endswith("proj"))
        return name, tensor

    def _qkv_of(self, name: str) -> QKVParallelLinear:
        """The q/k/v layer of the layer a checkpoint name (``model.layers.N. ...``) belongs to."""
        return self.model.layers[int(name.split(".")[2])].self_attn.qkv_proj

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.settings.family.fused_experts:
            weights = split_fused_experts(weights, self.settings.num_experts)
        return super().load_weights(self._stack_head_norms(weights))

    def _stack_head_norms(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """StableLM's per-head q/k norm tensors stacked into one (as its GGUF files and Cohere store them);
        every other tensor as it comes. A stack left incomplete is reported by the loader as missing."""
        pending: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in weights:
            match = _HEAD_NORM.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            stem = match.group(1)
            parts = pending.setdefault(stem, {})
            parts[int(match.group(2))] = tensor
            heads = self.settings.num_heads if stem.endswith("q_layernorm") else self.settings.num_kv_heads
            if len(parts) == heads:
                yield f"{stem}.weight", torch.stack([parts.pop(h) for h in range(heads)])
                del pending[stem]
