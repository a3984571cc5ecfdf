"""Llama family (Llama 2/3, Mistral, Qwen2, SmolLM): RMSNorm, RoPE, SwiGLU, grouped-query attention.

Inputs are a flattened batch: ``input_ids[T]`` and ``positions[T]`` for every token computed this
step, all sequences concatenated without padding; the attention backend finds the sequence
boundaries in the metadata.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.attention import AttentionMetadata, PagedAttention
from pagedllm.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    WeightLoader,
    apply_rotary,
    compute_inv_freq,
    get_activation,
    rope_parameters,
)
from pagedllm.models.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    lm_logits,
)


class LlamaAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        # Qwen2 always has q/k/v biases and never an o_proj bias; Llama's attention_bias covers all four.
        is_qwen2 = getattr(config, "model_type", "") == "qwen2"
        qkv_bias = attention_bias or is_qwen2
        o_bias = attention_bias and not is_qwen2
        # Under tensor parallelism this rank computes only its heads (and their KV heads).
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_kv_heads, bias=qkv_bias)
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=o_bias)
        self.attn = PagedAttention(self.num_heads, self.head_dim, self.num_kv_heads, scale=self.head_dim**-0.5)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        qk_size = self.q_size + self.kv_size
        # Rotate q and k in one go: they are adjacent in the fused output.
        qk = apply_rotary(qkv[:, :qk_size].view(num_tokens, -1, self.head_dim), *rope).view(num_tokens, qk_size)
        q, k = qk.split([self.q_size, self.kv_size], dim=-1)
        v = qkv[:, qk_size:]
        out = self.attn(q, k, v, kv_cache, attn_metadata)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(hidden, {"gate": inter, "up": inter}, bias=bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias)
        self.act = get_activation(getattr(config, "hidden_act", "silu"))
        self.intermediate_size = self.gate_up_proj.shard_slices["gate"][1]  # this rank's part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        h = self.self_attn(rope, self.input_layernorm(hidden), kv_cache, attn_metadata)
        h += hidden
        out = self.mlp(self.post_attention_layernorm(h))
        out += h
        return out


class LlamaModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, rope_parameters(config))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, getattr(config, "rms_norm_eps", 1e-6))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        for i, layer in enumerate(self.layers):
            hidden = layer(rope, hidden, kv_caches[i] if kv_caches is not None else None, attn_metadata)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """Llama, Mistral, Qwen2 and SmolLM checkpoints (HF parameter names)."""

    # HF linears fused here: checkpoint name part -> (our module, shard).
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    @staticmethod
    def check_config(hf_config: Any) -> None:
        """ValueError for variants this implementation does not cover (rope scaling, activation)."""
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        params = rope_parameters(hf_config)
        if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported.")
        compute_inv_freq(head_dim, params)
        get_activation(getattr(hf_config, "hidden_act", "silu"))

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.check_config(hf_config)
        self.config = hf_config
        self.model = LlamaModel(hf_config)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def logits_head(self) -> nn.Module:
        """The module whose weight is the output projection (the embedding when tied)."""
        return self.model.embed_tokens if self.tie_word_embeddings else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [N, vocab]; under tensor parallelism only rank 0 gets them (None elsewhere)."""
        return lm_logits(hidden, self.logits_head())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the parameter names loaded, raises ValueError if any is missing."""
        loader = WeightLoader(self, self.stacked_params)
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            if not name.startswith(("model.", "lm_head.")):
                name = "model." + name  # checkpoints of the bare LlamaModel
            loader.load(name, tensor)
        return loader.finish()
