"""Shapes, tensor layouts and GGUF metadata of the random-weight model zoo (make_gguf_models.py).

Each shape carries the published config.json values of the real model (Hugging Face hub; written
from knowledge, without network access: the values flagged "unsure" below are the ones to check
against the hub before quoting a figure that depends on them). Per architecture, ``layer_tensors``
lists the tensors llama.cpp's converter (convert_hf_to_gguf.py) writes, under its names and
shapes, and ``add_arch_metadata`` the keys it writes, as tests/gguf_families.py does for tiny
transformers models (names from gguf-py's tensor map; stacked experts [n_expert, rows, cols]).

Tensor roles (what make_gguf_models.tensor_plan turns into a ggml type, llama-quantize's way):
"embd", "output", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up",
"ffn_down", "experts" (3-D stacks), "ffn_down_exps" — quantized; "norm", "bias", "sinks", "router",
"rope_factors_long", "rope_factors_short" — F32.

Left out, as they change no speed figure: Llama-3.1-style rope scaling (the ``rope_freqs`` tensor
pagedllm refuses) for the Llamas, whose context stays 8192 as for the existing 1B / 8B; the
vision tower of Gemma 3 (text only); the real tokenizers (the default model's, padded or cut to
the vocabulary: make_gguf_models.add_tokenizer).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

# (GGUF name, numpy shape (out, in) / (n_expert, out, in), role)
TensorSpec = tuple[str, tuple[int, ...], str]

FLOAT_ROLES = ("norm", "bias", "sinks", "router", "rope_factors_long", "rope_factors_short")


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int  # feed_forward_length; for a mixture, each expert's width
    vocab: int
    tied: bool
    rope_theta: float
    rms_eps: float = 1e-5
    context: int = 8192
    arch: str = "llama"
    head_size: int = 0  # 0: hidden // heads
    sliding_window: int = 0
    experts: int = 0
    experts_used: int = 0
    # ("linear", factor) | ("yarn", factor, original context) | ("longrope", original context)
    rope_scaling: tuple[Any, ...] = ()
    # Granite: (attention, embedding, residual, logits) multipliers
    multipliers: tuple[float, float, float, float] | None = None

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads


SHAPES: dict[str, Shape] = {
    "1b": Shape("llama-3.2-1b-random", hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256,
                tied=True, rope_theta=500000.0),
    "8b": Shape("llama-3-8b-random", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                tied=False, rope_theta=500000.0),
    # meta-llama/Llama-3.2-3B: head_dim 128; its rope_scaling (llama3, factor 32) and 131072 context left out.
    "llama-3.2-3b": Shape("llama-3.2-3b-random", hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192,
                          vocab=128256, tied=True, rope_theta=500000.0),
    # Qwen/Qwen3-4B: q/k norms per head.
    "qwen3-4b": Shape("qwen3-4b-random", arch="qwen3", hidden=2560, layers=36, heads=32, kv_heads=8, head_size=128,
                      ffn=9728, vocab=151936, tied=True, rope_theta=1000000.0, rms_eps=1e-6, context=40960),
    # google/gemma-3-4b-it's text_config: 5 sliding (1024) layers per global one (llama.cpp's fixed pattern 6),
    # local rope base 10000 (llama.cpp's default), global rope linear x8.
    "gemma-3-4b": Shape("gemma-3-4b-random", arch="gemma3", hidden=2560, layers=34, heads=8, kv_heads=4,
                        head_size=256, ffn=10240, vocab=262208, tied=True, rope_theta=1000000.0, rms_eps=1e-6,
                        context=131072, sliding_window=1024, rope_scaling=("linear", 8.0)),
    # microsoft/Phi-3.5-mini-instruct: fused qkv and gate+up; longrope (original context 4096); its
    # sliding_window 262144 is written as the converter does (llama.cpp ignores it for phi3).
    "phi-3.5-mini": Shape("phi-3.5-mini-random", arch="phi3", hidden=3072, layers=32, heads=32, kv_heads=32, ffn=8192,
                          vocab=32064, tied=False, rope_theta=10000.0, context=131072, sliding_window=262144,
                          rope_scaling=("longrope", 4096)),
    # allenai/OLMo-2-0425-1B: no pre-norms, post-attention / post-ffn norms, full-width q/k norms.
    "olmo-2-1b": Shape("olmo-2-1b-random", arch="olmo2", hidden=2048, layers=16, heads=16, kv_heads=16, ffn=8192,
                       vocab=100352, tied=False, rope_theta=500000.0, rms_eps=1e-6, context=4096),
    # ibm-granite/granite-3.3-2b-instruct. Unsure: rope_theta (10000000 here; Granite 3.1's was 5000000) and
    # residual_multiplier 0.22.
    "granite-3.3-2b": Shape("granite-3.3-2b-random", arch="granite", hidden=2048, layers=40, heads=32, kv_heads=8,
                            ffn=8192, vocab=49159, tied=True, rope_theta=10000000.0, context=131072,
                            multipliers=(0.015625, 12.0, 0.22, 8.0)),
    # openai/gpt-oss-20b: 32 experts of width 2880, top 4; sliding window 128 on even layers; yarn x32 over 4096.
    "gpt-oss-20b": Shape("gpt-oss-20b-random", arch="gpt-oss", hidden=2880, layers=24, heads=64, kv_heads=8,
                         head_size=64, ffn=2880, vocab=201088, tied=False, rope_theta=150000.0, context=131072,
                         sliding_window=128, experts=32, experts_used=4, rope_scaling=("yarn", 32.0, 4096)),
}
# Layers of a --tiny variant: enough for one layer of each attention kind (Gemma 3: 5 sliding + 1 global).
_TINY_LAYERS = {"gemma3": 6}


def tiny(shape: Shape) -> Shape:
    """The same architecture and tensor layout, small: hidden 256 (Phi-3: 768, a whole number of its 96-wide
    heads and of K-quant blocks), the real head_dim, a few heads (q as wide as hidden where the real model's
    is: llama.cpp's OLMo 2 and Phi-3 require it; else 512), ffn 512 (mixtures: experts as wide as hidden, as
    GPT-OSS's are), 2 layers, vocab cut to 49152 where larger."""
    hd = shape.head_dim
    hidden = 768 if shape.arch == "phi3" else 256
    heads = hidden // hd if shape.heads * hd == shape.hidden else max(2, 512 // hd)
    kv_heads = heads if shape.kv_heads == shape.heads else max(1, heads // 4)
    return dataclasses.replace(
        shape, name=shape.name.replace("-random", "-tiny-random"), hidden=hidden, heads=heads, kv_heads=kv_heads,
        head_size=hd, ffn=hidden if shape.experts else 512, layers=_TINY_LAYERS.get(shape.arch, 2),
        vocab=shape.vocab if shape.vocab <= 65536 else 49152)


def layer_tensors(shape: Shape, i: int) -> list[TensorSpec]:
    """Layer ``i``'s tensors, in the converter's names, for ``shape.arch``."""
    h, hd, ffn = shape.hidden, shape.head_dim, shape.ffn
    q, kv = shape.heads * hd, shape.kv_heads * hd
    p = f"blk.{i}."
    arch = shape.arch
    qkv = [(p + "attn_q.weight", (q, h), "attn_q"), (p + "attn_k.weight", (kv, h), "attn_k"),
           (p + "attn_v.weight", (kv, h), "attn_v")]
    mlp = [(p + "ffn_gate.weight", (ffn, h), "ffn_gate"), (p + "ffn_up.weight", (ffn, h), "ffn_up"),
           (p + "ffn_down.weight", (h, ffn), "ffn_down")]
    out = (p + "attn_output.weight", (h, q), "attn_output")
    if arch in ("llama", "granite"):
        return [(p + "attn_norm.weight", (h,), "norm"), *qkv, out, (p + "ffn_norm.weight", (h,), "norm"), *mlp]
    if arch == "qwen3":
        return [(p + "attn_norm.weight", (h,), "norm"), *qkv, (p + "attn_q_norm.weight", (hd,), "norm"),
                (p + "attn_k_norm.weight", (hd,), "norm"), out, (p + "ffn_norm.weight", (h,), "norm"), *mlp]
    if arch == "gemma3":  # sandwich norms; norms stored 1 + weight (random: near 1 either way)
        return [(p + "attn_norm.weight", (h,), "norm"), *qkv, (p + "attn_q_norm.weight", (hd,), "norm"),
                (p + "attn_k_norm.weight", (hd,), "norm"), out, (p + "post_attention_norm.weight", (h,), "norm"),
                (p + "ffn_norm.weight", (h,), "norm"), *mlp, (p + "post_ffw_norm.weight", (h,), "norm")]
    if arch == "phi3":  # fused q|k|v rows and gate|up rows
        return [(p + "attn_norm.weight", (h,), "norm"), (p + "attn_qkv.weight", (q + 2 * kv, h), "attn_qkv"), out,
                (p + "ffn_norm.weight", (h,), "norm"), (p + "ffn_up.weight", (2 * ffn, h), "ffn_up"),
                (p + "ffn_down.weight", (h, ffn), "ffn_down")]
    if arch == "olmo2":  # no pre-norms; q/k norms over the whole q / k width
        return [*qkv, (p + "attn_q_norm.weight", (q,), "norm"), (p + "attn_k_norm.weight", (kv,), "norm"), out,
                (p + "post_attention_norm.weight", (h,), "norm"), *mlp, (p + "post_ffw_norm.weight", (h,), "norm")]
    if arch == "gpt-oss":
        e = shape.experts
        tensors: list[TensorSpec] = [(p + "attn_norm.weight", (h,), "norm")]
        for name, dims, role in (*qkv, out):
            tensors += [(name, dims, role), (name.replace(".weight", ".bias"), dims[:1], "bias")]
        return tensors + [
            (p + "attn_sinks.weight", (shape.heads,), "sinks"),
            (p + "post_attention_norm.weight", (h,), "norm"),
            (p + "ffn_gate_inp.weight", (e, h), "router"), (p + "ffn_gate_inp.bias", (e,), "bias"),
            (p + "ffn_gate_exps.weight", (e, ffn, h), "experts"), (p + "ffn_gate_exps.bias", (e, ffn), "bias"),
            (p + "ffn_up_exps.weight", (e, ffn, h), "experts"), (p + "ffn_up_exps.bias", (e, ffn), "bias"),
            (p + "ffn_down_exps.weight", (e, h, ffn), "ffn_down_exps"), (p + "ffn_down_exps.bias", (e, h), "bias"),
        ]
    raise ValueError(f"no tensor layout for architecture {arch!r}")


def model_tensors(shape: Shape) -> list[TensorSpec]:
    """Every tensor of the model, in file order: embedding, (Phi-3's rope factors), layers, final norm, head."""
    h = shape.hidden
    tensors: list[TensorSpec] = [("token_embd.weight", (shape.vocab, h), "embd")]
    if shape.rope_scaling[:1] == ("longrope",):
        half = shape.head_dim // 2
        tensors += [("rope_factors_long.weight", (half,), "rope_factors_long"),
                    ("rope_factors_short.weight", (half,), "rope_factors_short")]
    for i in range(shape.layers):
        tensors += layer_tensors(shape, i)
    tensors.append(("output_norm.weight", (h,), "norm"))
    if not shape.tied:
        tensors.append(("output.weight", (shape.vocab, h), "output"))
    return tensors


def float_values(rng: np.random.Generator, dims: tuple[int, ...], role: str) -> np.ndarray:
    """An F32 tensor of ``role``: norms near 1 (as trained RMSNorm gains, and Gemma's stored 1 + w, are),
    biases and routers ~N(0, 0.02), sinks ~N(0, 1) logits; Phi-3's rope factors a smooth ramp (the real
    lists are not reproduced: short factors 1 -> 1.5, long 1 -> 40, only their count matters here)."""
    if role == "norm":
        return (1.0 + 0.05 * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)
    if role == "sinks":
        return rng.standard_normal(dims, dtype=np.float32)
    if role == "rope_factors_short":
        return np.linspace(1.0, 1.5, dims[0], dtype=np.float32)
    if role == "rope_factors_long":
        return np.geomspace(1.0, 40.0, dims[0]).astype(np.float32)
    return (0.02 * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)


def add_arch_metadata(writer: Any, shape: Shape) -> None:
    """The ``{arch}.*`` keys llama.cpp's converter writes for ``shape.arch`` (vocab_size: the Llama-style
    converters, Llama and Granite)."""
    from gguf.constants import RopeScalingType

    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    if shape.arch in ("llama", "granite", "phi3"):
        writer.add_rope_dimension_count(shape.head_dim)
    if shape.arch in ("llama", "granite"):
        writer.add_vocab_size(shape.vocab)
    if shape.head_size:  # the converter writes key/value lengths where config.json has head_dim
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.multipliers is not None:  # Granite; logits_scaling is llama.cpp's logit_scale
        attention, embedding, residual, logits = shape.multipliers
        writer.add_attention_scale(attention)
        writer.add_embedding_scale(embedding)
        writer.add_residual_scale(residual)
        writer.add_logit_scale(logits)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.ffn)
    kind = shape.rope_scaling[:1]
    if kind == ("linear",):
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(shape.rope_scaling[1])
    elif kind == ("yarn",):
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(shape.rope_scaling[1])
        writer.add_rope_scaling_orig_ctx_len(shape.rope_scaling[2])
    elif kind == ("longrope",):  # Phi-3: the factors are tensors; the attention factor as the converter computes it
        original = shape.rope_scaling[1]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = shape.context / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
