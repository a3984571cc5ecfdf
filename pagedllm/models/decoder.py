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

from pagedllm.attention import AttentionMetadata
from pagedllm.layers.norms_and_activations import make_norm
from pagedllm.layers.parallel_layers import (
    QKVParallelLinear,
    VocabParallelEmbedding,
)
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.decoder_layer import DecoderLayer, KVCache
from pagedllm.models.families import DecoderSettings, decoder_settings
from pagedllm.models.layer_stack import LayerStack, build_layer_stack, weights_key
from pagedllm.models.moe import split_fused_experts
from pagedllm.models.rotary import RotaryEmbedding
from pagedllm.quantization.packed import PackedTensor


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
        self._stack_key: tuple[int, bool] | int | None = -1

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
            hidden, residual = stack.run(hidden, ropes, kv_caches, attn_metadata, plan)
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
