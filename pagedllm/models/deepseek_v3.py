"""DeepSeek-V3 (transformers' ``deepseek_v3``): multi-head latent attention and grouped-routed experts.

Attention compresses each token's keys and values into one latent row that the paged cache stores
(attention/mla.py); queries come from ``q_proj`` (V2-Lite style, ``q_lora_rank`` None) or through
the low-rank ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``. Rope turns only the last
``qk_rope_head_dim`` channels of each query head and the one shared rope key; with
``rope_interleave`` the checkpoint's rope channels come as pairs (2i, 2i + 1), which transformers
rotates as halves after gathering the even channels, then the odd ones; we do the same, so the
cached rope key has the layout transformers' cache holds. With yarn and ``mscale_all_dim`` the
softmax scale is multiplied by mscale^2, as transformers does.

The first ``first_k_dense_replace`` layers (and those off ``moe_layer_freq``) have a dense gated
MLP; the others route each token (deepseek_moe.py) to ``num_experts_per_tok`` of
``n_routed_experts`` experts, plus ``n_shared_experts`` shared experts every token goes through.

Not supported, refused at start-up: tensor parallelism (heads and experts are not split), a
quantized ``kv_cache_dtype`` (kv_spec.py), FP8 block-quantized checkpoints, and the
multi-token-prediction layers, whose weights are skipped when a checkpoint carries them.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn

from pagedllm.attention import AttentionMetadata
from pagedllm.attention.kv_spec import KVCacheSpec
from pagedllm.attention.mla import MultiHeadLatentAttention
from pagedllm.layers.norms_and_activations import RMSNorm
from pagedllm.layers.parallel_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from pagedllm.layers.parallel_state import get_tp_state
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.deepseek_moe import DeepseekMLP, DeepseekMoE
from pagedllm.models.rotary import RotaryEmbedding, apply_rotary, rope_parameters

Rope = tuple[torch.Tensor, torch.Tensor]
LatentCache = tuple[torch.Tensor, ...]

# transformers builds the q_a / kv_a norms with their default eps, not the config's rms_norm_eps.
_LATENT_NORM_EPS = 1e-6
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def softmax_scale(config: Any) -> float:
    """qk_head_dim^-0.5, times mscale^2 for a scaled rope with ``mscale_all_dim`` (transformers'
    yarn_apply_mscale)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim") or 0
    factor = float(params.get("factor") or 1.0)
    if params["rope_type"] != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def moe_layer(config: Any, layer: int) -> bool:
    """Whether a layer routes to experts: past the dense ones, every ``moe_layer_freq``-th (vLLM's and
    DeepSeek's rule; transformers has no moe_layer_freq, i.e. 1)."""
    freq = int(getattr(config, "moe_layer_freq", 1) or 1)
    return bool(config.n_routed_experts) and layer >= (config.first_k_dense_replace or 0) and layer % freq == 0


class DeepseekV3Attention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads = heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.rope_interleave = bool(getattr(config, "rope_interleave", False))
        q_width = heads * (self.nope_dim + self.rope_dim)
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_width, bias=False)
        else:
            self.q_a_proj = ColumnParallelLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS)
        # A plain linear: attention reads its weight per head (W_UK, W_UV), which packing would drop.
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, heads * (self.nope_dim + config.v_head_dim), bias=False)
        self.o_proj = RowParallelLinear(heads * config.v_head_dim, hidden, bias=bias)
        self.attn = MultiHeadLatentAttention(heads, self.nope_dim, self.rope_dim, config.v_head_dim,
                                             self.kv_lora_rank, softmax_scale(config))

    def _rotate(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        if self.rope_interleave:  # pairs (2i, 2i + 1) -> halves, as transformers rotates them
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rotary(x, *rope)

    def forward(self, rope: Rope, hidden: torch.Tensor, kv_cache: LatentCache | None,
                meta: AttentionMetadata | None) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_pe = q.view(num_tokens, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe = self._rotate(q_pe, rope)
        k_pe = self._rotate(k_pe.unsqueeze(1), rope).squeeze(1)
        out = self.attn(q_nope, q_pe, latent, k_pe, self.kv_b_proj.weight, kv_cache, meta)
        return self.o_proj(out)


class DeepseekV3Layer(nn.Module):
    def __init__(self, config: Any, layer: int) -> None:
        super().__init__()
        self.self_attn = DeepseekV3Attention(config)
        if moe_layer(config, layer):
            self.mlp: nn.Module = DeepseekMoE(config)
        else:
            self.mlp = DeepseekMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope: Rope, hidden: torch.Tensor, residual: torch.Tensor | None, kv_cache: LatentCache | None,
                meta: AttentionMetadata | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> the next layer's, each residual add fused into the norm after it."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekV3Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV3Layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)  # over head_dim, which DeepseekV3Config sets to qk_rope_head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LatentCache] | None,
                attn_metadata: AttentionMetadata | None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            kv_cache = kv_caches[i] if kv_caches is not None else None
            hidden, residual = layer(rope, hidden, residual, kv_cache, attn_metadata)
        return self.norm(hidden, residual)[0]


class DeepseekV3ForCausalLM(CausalLM):
    stacked_params = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}

    @staticmethod
    def check_config(hf_config: Any) -> None:
        """ValueError for what this implementation does not cover, before anything is allocated."""
        quant = getattr(hf_config, "quantization_config", None)
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
            raise ValueError(f"DeepSeek-V3 checkpoints quantized with {method!r} are not supported; "
                             "use a bfloat16 / float32 checkpoint.")
        for name, expected in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
            value = getattr(hf_config, name, expected)
            if value != expected:
                raise ValueError(f"DeepSeek-V3 with {name}={value!r} is not supported (only {expected!r}).")
        if hf_config.n_routed_experts and hf_config.n_routed_experts % (hf_config.n_group or 1):
            raise ValueError(f"n_routed_experts ({hf_config.n_routed_experts}) must be a multiple of n_group "
                             f"({hf_config.n_group}).")
        RotaryEmbedding(hf_config)  # refuses rope variants we do not implement

    @staticmethod
    def kv_cache_spec(hf_config: Any) -> KVCacheSpec:
        """One latent row per token and layer: the compressed KV and the shared rope key."""
        return KVCacheSpec(num_pools=1, num_heads=1, head_dim=hf_config.kv_lora_rank + hf_config.qk_rope_head_dim)

    def __init__(self, hf_config: Any) -> None:
        if get_tp_state().world_size > 1:
            raise ValueError("DeepSeek-V3 is not supported with tensor parallelism (tensor_parallel_size > 1): "
                             "its latent attention and experts are not split across ranks.")
        super().__init__(hf_config, tie_default=False)
        self.model = DeepseekV3Model(hf_config)
        self.add_lm_head(hf_config.hidden_size)

    def backbone(self) -> nn.Module:
        return self.model

    def embedding(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if "rotary_emb." in name:
            return None
        layer = _LAYER.match(name)
        if layer is not None and int(layer.group(1)) >= self.config.num_hidden_layers:
            return None  # the multi-token-prediction layers after the last one: not used here
        return name, tensor
