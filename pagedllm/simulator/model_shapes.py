"""Model shapes for the simulator: what the cost model and the KV pool size need, no weights."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from pagedllm.kv_cache_format import KVCacheFormat, parse_kv_cache_dtype


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    dtype_bytes: int = 2  # fp16, as the paper serves
    gated_mlp: bool = False  # LLaMA's SwiGLU has three MLP matrices, OPT's two
    # How the KV cache is stored (vLLM's names, as EngineArgs.kv_cache_dtype): "auto" keeps the
    # model dtype; weights and activations stay in the model dtype whatever this says.
    kv_cache_dtype: str = "auto"
    kv_cache_format: KVCacheFormat = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Parsed once (kv_cache_format.py): the canonical name ("fp8" -> "fp8_e4m3"), an early error
        # for an unusable format.
        fmt = parse_kv_cache_dtype(self.kv_cache_dtype)
        fmt.check_head_dim(self.head_dim)
        object.__setattr__(self, "kv_cache_format", fmt)
        object.__setattr__(self, "kv_cache_dtype", fmt.name)

    def with_kv_cache_dtype(self, kv_cache_dtype: str) -> ModelShape:
        """The same model with its KV cache stored as ``kv_cache_dtype``."""
        return dataclasses.replace(self, kv_cache_dtype=kv_cache_dtype)

    @property
    def num_params(self) -> int:
        attn = 2 * self.hidden_size * self.head_dim * (self.num_heads + self.num_kv_heads)  # q, o + k, v
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        return self.num_layers * (attn + mlp) + self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_row_bytes(self) -> int:
        """One (token, KV head) row of K or V in the chosen KV format, scales included."""
        return self.kv_cache_format.row_bytes(self.head_dim, self.dtype_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: 800 KB for OPT-13B in fp16, as the paper says (412.5 KiB in int8)."""
        return 2 * self.num_layers * self.num_kv_heads * self.kv_row_bytes

    def activation_bytes(self, max_num_batched_tokens: int) -> int:
        """Peak activations of the largest step (a rough bound, as a profiling pass would measure)."""
        per_token = (4 * self.hidden_size + 2 * self.intermediate_size) * self.dtype_bytes
        logits = self.vocab_size * 4  # float32 logits, one row per sequence sampled
        return max_num_batched_tokens * per_token + 256 * logits


def _opt(name: str, layers: int, hidden: int, heads: int) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, heads, hidden // heads, 4 * hidden, 50272, 2048)


MODEL_SHAPES: dict[str, ModelShape] = {
    "opt-13b": _opt("opt-13b", 40, 5120, 40),
    "opt-66b": _opt("opt-66b", 64, 9216, 72),
    "opt-175b": _opt("opt-175b", 96, 12288, 96),
    "llama-13b": ModelShape("llama-13b", 40, 5120, 40, 40, 128, 13824, 32000, 2048, gated_mlp=True),
    # The embedded default model (SmolLM2-135M), for calibration against real CPU runs.
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, 8192, dtype_bytes=4, gated_mlp=True),
}


def shape_from_hf_config(config: dict, name: str = "hf-model", dtype_bytes: int = 2,
                         kv_cache_dtype: str = "auto") -> ModelShape:
    """A shape from a Hugging Face config.json dict (Llama/Mistral/Qwen2, OPT, GPT-2 names)."""
    hidden = config.get("hidden_size") or config.get("n_embd") or config["d_model"]
    heads = config.get("num_attention_heads") or config["n_head"]
    layers = config.get("num_hidden_layers") or config["n_layer"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    ffn = config.get("intermediate_size") or config.get("ffn_dim") or config.get("n_inner") or 4 * hidden
    max_len = config.get("max_position_embeddings") or config.get("n_positions") or 2048
    gated = config.get("model_type") in ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3")
    return ModelShape(name, layers, hidden, heads, kv_heads, head_dim, ffn, config.get("vocab_size", 32000),
                      max_len, dtype_bytes, gated, kv_cache_dtype)


def get_model_shape(name_or_path: str, kv_cache_dtype: str = "auto") -> ModelShape:
    """A preset name (opt-13b, opt-66b, opt-175b, llama-13b, smollm2-135m), a config.json, or a folder with
    one; its KV cache stored as ``kv_cache_dtype``."""
    key = name_or_path.lower()
    if key in MODEL_SHAPES:
        return MODEL_SHAPES[key].with_kv_cache_dtype(kv_cache_dtype)
    path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
    if not os.path.isfile(path):
        raise ValueError(f"unknown model {name_or_path!r}: use one of {', '.join(MODEL_SHAPES)} or a config.json path")
    with open(path) as f:
        return shape_from_hf_config(json.load(f), name=os.path.basename(os.path.dirname(os.path.abspath(path))),
                                    kv_cache_dtype=kv_cache_dtype)
