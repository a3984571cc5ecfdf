"""The decoder families: how each differs from Llama, as data, and the settings a config resolves to.

Every family here runs on the one decoder of decoder.py. A family names its norm (RMSNorm,
Gemma's ``1 + weight`` RMSNorm, LayerNorm), whether it has per-head q/k norms, Gemma's extra
norms around attention and MLP, GPT-NeoX's parallel residual, a gated or plain MLP or a mixture of
experts, embedding scaling, and how its checkpoint names map onto ours. The rest (biases,
activation, soft-capping, sliding windows, rope) is read from the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.models.layers import get_activation
from pagedllm.models.rotary import check_rope, head_dim_of, rope_layer_key


@dataclass(frozen=True, slots=True)
class Family:
    architectures: tuple[str, ...]
    norm: str = "rms"  # "rms", "gemma_rms" (scales by 1 + weight) or "layer" (LayerNorm with bias)
    qk_norm: bool = False  # a norm over each q and k head before rope (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and before/after the MLP
    parallel_residual: bool = False  # GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x)), if the config says so
    gated_mlp: bool = True  # act(gate(x)) * up(x); False: act(up(x))
    moe: bool = False  # sparse mixture of experts in place of the MLP
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    bias_key: str = "attention_bias"  # the config switch for the attention projections' biases
    qkv_bias: bool | None = None  # fixed by the family (None: the config's bias_key)
    o_bias: bool | None = None
    mlp_bias_key: str = "mlp_bias"
    mlp_bias: bool | None = None
    qkv_per_head: bool = False  # one fused tensor holding [q, k, v] of each head in turn (GPT-NeoX)
    prefix: str = "model."  # the backbone's prefix in checkpoints
    # Checkpoint name parts -> ours (matched with the dots around them).
    renames: tuple[tuple[str, str], ...] = ()


_MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                  (".w2.", ".down_proj."))
_NEOX_NAMES = ((".embed_in.", ".embed_tokens."), (".attention.query_key_value.", ".self_attn.qkv_proj."),
               (".attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.c_fc."),
               (".mlp.dense_4h_to_h.", ".mlp.c_proj."), (".final_layer_norm.", ".norm."),
               (".embed_out.", ".lm_head."))

# model_type -> family.
FAMILIES: dict[str, Family] = {
    "llama": Family(("LlamaForCausalLM",)),
    "mistral": Family(("MistralForCausalLM",)),
    "qwen2": Family(("Qwen2ForCausalLM",), qkv_bias=True, o_bias=False),
    "qwen3": Family(("Qwen3ForCausalLM",), qk_norm=True),
    "qwen3_moe": Family(("Qwen3MoeForCausalLM",), qk_norm=True, moe=True),
    "mixtral": Family(("MixtralForCausalLM",), moe=True, renames=_MIXTRAL_NAMES),
    "gemma": Family(("GemmaForCausalLM",), norm="gemma_rms", scale_embeddings=True),
    "gemma2": Family(("Gemma2ForCausalLM",), norm="gemma_rms", sandwich_norms=True, scale_embeddings=True),
    "gemma3_text": Family(("Gemma3ForCausalLM",), norm="gemma_rms", qk_norm=True, sandwich_norms=True,
                          scale_embeddings=True),
    "phi3": Family(("Phi3ForCausalLM",)),
    "gpt_neox": Family(("GPTNeoXForCausalLM",), norm="layer", parallel_residual=True, gated_mlp=False,
                       mlp_bias=True, qkv_per_head=True, prefix="gpt_neox.", renames=_NEOX_NAMES),
    "starcoder2": Family(("Starcoder2ForCausalLM",), norm="layer", gated_mlp=False, bias_key="use_bias",
                         mlp_bias_key="use_bias"),
}


def family_of(hf_config: Any) -> Family:
    model_type = getattr(hf_config, "model_type", "")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not a decoder family pagedllm implements.")
    return FAMILIES[model_type]


@dataclass(frozen=True, slots=True)
class DecoderSettings:
    """One model's decoder, resolved from its config and family."""

    family: Family
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    activation: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    parallel_residual: bool
    attn_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    embed_scale: float | None
    layer_windows: tuple[int | None, ...]  # per layer: attend to the last W positions only
    layer_rope_keys: tuple[str | None, ...]  # per layer: which rope settings (Gemma 3: local / global)
    moe_layers: tuple[bool, ...]
    num_experts: int
    num_experts_per_token: int
    normalize_expert_weights: bool
    expert_intermediate_size: int


def _first(config: Any, *keys: str, default: Any = None) -> Any:
    for key in keys:
        value = getattr(config, key, None)
        if value is not None:
            return value
    return default


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """The sliding window of each layer (None: global attention)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    num_layers = config.num_hidden_layers
    if layer_types:
        return tuple(int(window) if window and kind == "sliding_attention" else None for kind in layer_types)
    return (int(window) if window else None,) * num_layers


def decoder_settings(config: Any) -> DecoderSettings:
    """The settings of a config's decoder; ValueError for a variant the decoder cannot express."""
    family = family_of(config)
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("Bidirectional attention (use_bidirectional_attention=True) is not supported.")
    num_layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None) or [None] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers.")
    rope_keys = tuple(rope_layer_key(config, kind) for kind in layer_types)
    for key in set(rope_keys):
        check_rope(config, key)
    activation = _first(config, "hidden_activation", "hidden_act", default="silu")
    get_activation(activation)
    head_dim = head_dim_of(config)
    bias = bool(getattr(config, family.bias_key, False))
    num_experts = int(_first(config, "num_local_experts", "num_experts", default=0)) if family.moe else 0
    sparse_step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense_layers = set(getattr(config, "mlp_only_layers", None) or ())
    moe_layers = tuple(
        num_experts > 0 and i not in dense_layers and (i + 1) % sparse_step == 0 for i in range(num_layers)
    )
    scalar = getattr(config, "query_pre_attn_scalar", None)
    return DecoderSettings(
        family=family,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=num_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=_first(config, "num_key_value_heads", default=config.num_attention_heads),
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        norm_eps=float(_first(config, "rms_norm_eps", "layer_norm_eps", "norm_epsilon", default=1e-6)),
        activation=activation,
        qkv_bias=bias if family.qkv_bias is None else family.qkv_bias,
        o_bias=bias if family.o_bias is None else family.o_bias,
        mlp_bias=bool(getattr(config, family.mlp_bias_key, False)) if family.mlp_bias is None else family.mlp_bias,
        parallel_residual=family.parallel_residual and bool(getattr(config, "use_parallel_residual", True)),
        attn_scale=float(scalar if scalar else head_dim) ** -0.5,
        attn_softcap=getattr(config, "attn_logit_softcapping", None) or None,
        final_softcap=getattr(config, "final_logit_softcapping", None) or None,
        embed_scale=config.hidden_size**0.5 if family.scale_embeddings else None,
        layer_windows=layer_windows(config),
        layer_rope_keys=rope_keys,
        moe_layers=moe_layers,
        num_experts=num_experts,
        num_experts_per_token=int(getattr(config, "num_experts_per_tok", 0) or 0),
        normalize_expert_weights=bool(getattr(config, "norm_topk_prob", True)),
        expert_intermediate_size=int(_first(config, "moe_intermediate_size", "intermediate_size", default=0)),
    )
