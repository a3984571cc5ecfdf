"""The decoder families: how each differs from Llama, as data, and the settings a config resolves to.

Every family here runs on the one decoder of decoder.py. A family names its norm (RMSNorm,
Gemma's ``1 + weight`` RMSNorm, LayerNorm with or without bias), its q/k norms (per head, a weight
per head, or over the whole projection), where its norms sit (before each block, Gemma's extra
norms around attention and MLP, OLMo 2's after each block), GPT-NeoX's parallel residual (with two
input norms or, Phi and Cohere, one), a gated or plain MLP or a mixture of experts, embedding
scaling, interleaved rope, which layers go without rope, and how its checkpoint names map onto
ours. The rest (biases, activation, soft-capping, sliding windows, rope, Granite's and Cohere's
multipliers) is read from the config. The architectures of transformers it does not serve are
listed, with what each lacks, in unsupported_families.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.layers.norms_and_activations import get_activation
from pagedllm.models.rotary import check_rope, head_dim_of, rope_layer_key
from pagedllm.models.unsupported_families import unsupported_reason


@dataclass(frozen=True, slots=True)
class Family:
    architectures: tuple[str, ...]
    # "rms", "gemma_rms" (scales by 1 + weight), "layer" (LayerNorm with bias) or "layer_nobias" (Cohere)
    norm: str = "rms"
    qk_norm: bool = False  # a norm over each q and k head before rope (Qwen3, Gemma 3)
    qk_norm_key: str | None = None  # the config switch for the q/k norms where the family leaves them optional
    # "head": one weight shared by the heads; "heads": a weight per head, [heads, head_dim] (StableLM, Cohere);
    # "projection": one RMSNorm over the whole q (k) projection, all heads together (OLMo 2).
    qk_norm_shape: str = "head"
    qk_norm_kind: str | None = None  # the q/k norms' kind where it is not the family's norm
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and before/after the MLP
    # "pre": norm, then attention / MLP, then the residual add; "post" (OLMo 2): no input norm, each block's
    # output normed before its residual add: x + norm(attn(x)), then x + norm(mlp(x)).
    norm_placement: str = "pre"
    parallel_residual: bool = False  # GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x)), if the config says so
    shared_input_norm: bool = False  # the parallel block with one input norm: x + attn(ln(x)) + mlp(ln(x))
    # Cohere rotates channel pairs (2i, 2i + 1); its q/k rows are reordered at load so that the rope over
    # halves computes the same dot products (and keeps its fused kernel).
    rope_interleaved: bool = False
    nope_full_attention: bool = False  # Cohere 2: the full-attention layers have no rope
    # EXAONE 4: its full-attention layers lose rope only in a model that has sliding layers (sliding_window set).
    nope_needs_window: bool = False
    # The config's per-layer list that says which layers rotate q and k (SmolLM3's no_rope_layers: 1 = rope).
    rope_layers_key: str | None = None
    lm_head_bias: bool = False  # Phi-2
    gated_mlp: bool = True  # act(gate(x)) * up(x); False: act(up(x))
    moe: bool = False  # sparse mixture of experts in place of the MLP
    shared_expert: bool = False  # Qwen2-MoE: an expert every token runs too, scaled by a sigmoid gate
    # "softmax_topk": softmax over every expert, then the top k (renormalized if norm_topk_prob);
    # "topk_softmax" (GPT-OSS): the top k router logits, then a softmax over those k.
    routing: str = "softmax_topk"
    router_bias: bool = False  # GPT-OSS: the router linear has a bias
    expert_bias: bool = False  # GPT-OSS: each expert's gate/up and down have biases
    # GPT-OSS: experts stored fused as 3-D tensors (gate/up interleaved), split per expert at load.
    fused_experts: bool = False
    attention_sinks: bool = False  # GPT-OSS: a learned logit per head joins every softmax's denominator
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    bias_key: str = "attention_bias"  # the config switch for the attention projections' biases
    qkv_bias: bool | None = None  # fixed by the family (None: the config's bias_key)
    o_bias: bool | None = None
    o_bias_key: str | None = None  # the o projection's own config switch (Seed-OSS: attention_out_bias)
    mlp_bias_key: str = "mlp_bias"
    mlp_bias: bool | None = None
    qkv_per_head: bool = False  # one fused tensor holding [q, k, v] of each head in turn (GPT-NeoX)
    prefix: str = "model."  # the backbone's prefix in checkpoints
    # Checkpoint name parts -> ours (matched with the dots around them).
    renames: tuple[tuple[str, str], ...] = ()


_MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                  (".w2.", ".down_proj."))
# StableLM and Phi name their q/k norms apart (StableLM's per head, stacked at load: DecoderForCausalLM).
_QK_LAYERNORM_NAMES = ((".q_layernorm.", ".q_norm."), (".k_layernorm.", ".k_norm."))
_PHI_NAMES = ((".self_attn.dense.", ".self_attn.o_proj."), (".mlp.fc1.", ".mlp.c_fc."), (".mlp.fc2.", ".mlp.c_proj."),
              (".final_layernorm.", ".norm."), *_QK_LAYERNORM_NAMES)
_GPT_OSS_NAMES = ((".mlp.router.", ".mlp.gate."),)
_NEOX_NAMES = ((".embed_in.", ".embed_tokens."), (".attention.query_key_value.", ".self_attn.qkv_proj."),
               (".attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.c_fc."),
               (".mlp.dense_4h_to_h.", ".mlp.c_proj."), (".final_layer_norm.", ".norm."),
               (".embed_out.", ".lm_head."))
# GLM-4's norms around each block, onto Gemma 2's names for the same places.
_GLM4_NAMES = ((".post_attention_layernorm.", ".pre_feedforward_layernorm."),
               (".post_self_attn_layernorm.", ".post_attention_layernorm."),
               (".post_mlp_layernorm.", ".post_feedforward_layernorm."))
# EXAONE 3's own names (its checkpoints keep them; transformers maps them onto Llama's).
_EXAONE_NAMES = ((".wte.", ".embed_tokens."), (".h.", ".layers."), (".ln_f.", ".norm."),
                 (".attn.attention.", ".self_attn."), (".out_proj.", ".o_proj."), (".ln_1.", ".input_layernorm."),
                 (".ln_2.", ".post_attention_layernorm."), (".c_fc_0.", ".gate_proj."), (".c_fc_1.", ".up_proj."),
                 (".c_proj.", ".down_proj."))

# model_type -> family.
FAMILIES: dict[str, Family] = {
    "llama": Family(("LlamaForCausalLM",)),
    "mistral": Family(("MistralForCausalLM",)),
    "qwen2": Family(("Qwen2ForCausalLM",), qkv_bias=True, o_bias=False),
    "qwen3": Family(("Qwen3ForCausalLM",), qk_norm=True),
    "qwen3_moe": Family(("Qwen3MoeForCausalLM",), qk_norm=True, moe=True),
    "qwen2_moe": Family(("Qwen2MoeForCausalLM",), moe=True, shared_expert=True, bias_key="qkv_bias", o_bias=False),
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
    "olmo2": Family(("Olmo2ForCausalLM",), qk_norm=True, qk_norm_shape="projection", norm_placement="post"),
    "olmo3": Family(("Olmo3ForCausalLM",), qk_norm=True, qk_norm_shape="projection", norm_placement="post"),
    # Granite's multipliers are config settings (decoder_settings reads them for every family).
    "granite": Family(("GraniteForCausalLM",)),
    "stablelm": Family(("StableLmForCausalLM",), norm="layer", qk_norm_key="qk_layernorm", qk_norm_shape="heads",
                       qk_norm_kind="layer_nobias", parallel_residual=True, shared_input_norm=True,
                       bias_key="use_qkv_bias", o_bias=False, mlp_bias=False, renames=_QK_LAYERNORM_NAMES),
    "phi": Family(("PhiForCausalLM",), norm="layer", qk_norm_key="qk_layernorm", parallel_residual=True,
                  shared_input_norm=True, gated_mlp=False, qkv_bias=True, o_bias=True, mlp_bias=True,
                  lm_head_bias=True, renames=_PHI_NAMES),
    "cohere": Family(("CohereForCausalLM",), norm="layer_nobias", qk_norm_key="use_qk_norm", qk_norm_shape="heads",
                     parallel_residual=True, shared_input_norm=True, rope_interleaved=True),
    "cohere2": Family(("Cohere2ForCausalLM",), norm="layer_nobias", parallel_residual=True, shared_input_norm=True,
                      rope_interleaved=True, nope_full_attention=True),
    # Sliding and full layers alternate (layer_types); the experts' clamped SwiGLU is read from the config.
    "gpt_oss": Family(("GptOssForCausalLM",), moe=True, routing="topk_softmax", router_bias=True, expert_bias=True,
                      fused_experts=True, attention_sinks=True, renames=_GPT_OSS_NAMES),
    # Llama's layers under other names or configs.
    "exaone": Family(("LlamaForCausalLM",), prefix="transformer.", renames=_EXAONE_NAMES),
    "internlm3": Family(("LlamaForCausalLM",)),
    "iquestcoder": Family(("LlamaForCausalLM",)),
    "cwm": Family(("CwmForCausalLM",), qkv_bias=False, o_bias=False),  # sliding and full layers (layer_types)
    "ministral": Family(("MinistralForCausalLM",), qkv_bias=False, o_bias=False),
    "seed_oss": Family(("SeedOssForCausalLM",), o_bias_key="attention_out_bias"),
    "smollm3": Family(("SmolLM3ForCausalLM",), rope_layers_key="no_rope_layers"),
    # Rope over channel pairs: Helium and ERNIE 4.5 over the whole head, GLM and GLM-4 over the first
    # partial_rotary_factor of it.
    "helium": Family(("HeliumForCausalLM",), rope_interleaved=True, o_bias=False),
    "ernie4_5": Family(("Ernie4_5ForCausalLM",), rope_interleaved=True, bias_key="use_bias", mlp_bias_key="use_bias"),
    "glm": Family(("GlmForCausalLM",), rope_interleaved=True, o_bias=False),
    "glm4": Family(("Glm4ForCausalLM",), rope_interleaved=True, o_bias=False, sandwich_norms=True,
                   renames=_GLM4_NAMES),
    # Gemma 2 without the norms after attention and after the MLP.
    "vaultgemma": Family(("VaultGemmaForCausalLM",), norm="gemma_rms", scale_embeddings=True,
                         renames=((".pre_feedforward_layernorm.", ".post_attention_layernorm."),)),
    # OLMo 2's norms after each block with q/k norms per head; rope on the sliding layers only.
    "exaone4": Family(("Exaone4ForCausalLM",), qk_norm=True, norm_placement="post", nope_full_attention=True,
                      nope_needs_window=True),
    "olmoe": Family(("OlmoeForCausalLM",), qk_norm=True, qk_norm_shape="projection", moe=True),
    "flex_olmo": Family(("FlexOlmoForCausalLM",), qk_norm=True, qk_norm_shape="projection", norm_placement="post",
                        moe=True),
    "mellum": Family(("MellumForCausalLM",), qk_norm=True, moe=True),  # dense and sparse layers: mlp_layer_types
}


def family_of(hf_config: Any) -> Family:
    model_type = getattr(hf_config, "model_type", "")
    if model_type not in FAMILIES:
        reason = unsupported_reason(model_type)
        raise ValueError(f"{reason}." if reason else f"model_type {model_type!r} is not a decoder family pagedllm "
                         "implements.")
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
    shared_input_norm: bool  # the parallel block's one input norm (Phi, Cohere, parallel StableLM)
    norm_placement: str  # Family.norm_placement
    qk_norm: str | None  # the q/k norms' shape (Family.qk_norm_shape); None: no q/k norms
    qk_norm_kind: str
    attn_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    embed_scale: float | None
    residual_scale: float | None  # Granite: each block's output times this before its residual add
    logit_scale: float | None  # logits times this (Cohere's logit_scale; Granite divides by logits_scaling)
    layer_windows: tuple[int | None, ...]  # per layer: attend to the last W positions only
    layer_rope_keys: tuple[str | None, ...]  # per layer: which rope settings (Gemma 3: local / global)
    layer_rope: tuple[bool, ...]  # per layer: whether q and k are rotated (Cohere 2's global layers: no)
    moe_layers: tuple[bool, ...]
    num_experts: int
    num_experts_per_token: int
    normalize_expert_weights: bool
    expert_intermediate_size: int
    shared_expert_intermediate_size: int  # 0: no shared expert
    # GPT-OSS's experts: gate.clamp(max=limit), up.clamp(-limit, limit), (up + 1) * gate * sigmoid(alpha * gate);
    # None: the activation's plain act(gate) * up.
    swiglu_limit: float | None
    swiglu_alpha: float


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


def _multiplier(config: Any, key: str) -> float | None:
    """A scale the config sets (Granite, Cohere); None where it is absent or 1 (nothing to multiply)."""
    value = getattr(config, key, None)
    return None if value is None or float(value) == 1.0 else float(value)


def _o_bias(config: Any, family: Family, qkv_switch: bool) -> bool:
    if family.o_bias is not None:
        return family.o_bias
    if family.o_bias_key is not None:
        return bool(getattr(config, family.o_bias_key, False))
    return qkv_switch


def layer_rope(config: Any, family: Family, layer_types: list[str | None]) -> tuple[bool, ...]:
    """Per layer: whether q and k are rotated."""
    if family.rope_layers_key is not None:
        flags = getattr(config, family.rope_layers_key, None)
        if flags is not None:
            if len(flags) != len(layer_types):
                raise ValueError(f"{family.rope_layers_key} has {len(flags)} entries for {len(layer_types)} layers.")
            return tuple(bool(flag) for flag in flags)
    nope_full = family.nope_full_attention and (
        not family.nope_needs_window or getattr(config, "sliding_window", None) is not None)
    return tuple(not (nope_full and kind != "sliding_attention") for kind in layer_types)


def decoder_settings(config: Any) -> DecoderSettings:
    """The settings of a config's decoder; ValueError for a variant the decoder cannot express."""
    family = family_of(config)
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("Bidirectional attention (use_bidirectional_attention=True) is not supported.")
    if getattr(config, "clip_qkv", None) is not None:
        # OLMo's and OLMoE's optional clamp of q, k and v: no layer here clamps them.
        raise ValueError(f"clip_qkv={config.clip_qkv} (q, k and v clamped) is not supported.")
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
    shared_expert = family.shared_expert and num_experts > 0
    shared_size = int(getattr(config, "shared_expert_intermediate_size", 0) or 0) if shared_expert else 0
    sparse_step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense_layers = set(getattr(config, "mlp_only_layers", None) or ())
    mlp_types = getattr(config, "mlp_layer_types", None) or ["sparse"] * num_layers  # Mellum: "sparse" / "dense"
    moe_layers = tuple(
        num_experts > 0 and i not in dense_layers and (i + 1) % sparse_step == 0 and mlp_types[i] == "sparse"
        for i in range(num_layers)
    )
    scalar = getattr(config, "query_pre_attn_scalar", None)
    attn_scale = getattr(config, "attention_multiplier", None)  # Granite: the scale itself, 1.0 included
    parallel = family.parallel_residual and bool(getattr(config, "use_parallel_residual", True))
    has_qk_norm = family.qk_norm or bool(family.qk_norm_key and getattr(config, family.qk_norm_key, False))
    divisor = _multiplier(config, "logits_scaling")  # Granite divides the logits by it
    logit_scale = _multiplier(config, "logit_scale") if divisor is None else 1.0 / divisor
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
        o_bias=_o_bias(config, family, bias),
        mlp_bias=bool(getattr(config, family.mlp_bias_key, False)) if family.mlp_bias is None else family.mlp_bias,
        parallel_residual=parallel,
        shared_input_norm=parallel and family.shared_input_norm,
        norm_placement=family.norm_placement,
        qk_norm=family.qk_norm_shape if has_qk_norm else None,
        qk_norm_kind=family.qk_norm_kind or family.norm,
        attn_scale=float(attn_scale) if attn_scale is not None else float(scalar if scalar else head_dim) ** -0.5,
        attn_softcap=getattr(config, "attn_logit_softcapping", None) or None,
        final_softcap=getattr(config, "final_logit_softcapping", None) or None,
        embed_scale=config.hidden_size**0.5 if family.scale_embeddings else _multiplier(config, "embedding_multiplier"),
        residual_scale=_multiplier(config, "residual_multiplier"),
        logit_scale=logit_scale,
        layer_windows=layer_windows(config),
        layer_rope_keys=rope_keys,
        layer_rope=layer_rope(config, family, layer_types),
        moe_layers=moe_layers,
        num_experts=num_experts,
        num_experts_per_token=int(getattr(config, "num_experts_per_tok", 0) or 0),
        normalize_expert_weights=bool(getattr(config, "norm_topk_prob", True)),
        expert_intermediate_size=int(_first(config, "moe_intermediate_size", "intermediate_size", default=0)),
        shared_expert_intermediate_size=shared_size,
        swiglu_limit=float(config.swiglu_limit) if getattr(config, "swiglu_limit", None) is not None else None,
        swiglu_alpha=float(getattr(config, "swiglu_alpha", None) or 1.702),
    )
