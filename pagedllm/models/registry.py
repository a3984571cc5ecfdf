"""HF ``architectures[0]`` -> our model class."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torch import nn

from pagedllm.attention.kv_spec import KVCacheSpec
from pagedllm.kv_cache_format import AUTO, KVCacheFormat
from pagedllm.models.families import FAMILIES
from pagedllm.models.unsupported_families import unsupported_reason

if TYPE_CHECKING:
    from pagedllm.config import ModelConfig

# architecture name -> (module under pagedllm.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    **{arch: ("decoder", "DecoderForCausalLM") for family in FAMILIES.values() for arch in family.architectures},
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
}
# For configs saved without ``architectures`` (e.g. a bare LlamaConfig).
_MODEL_TYPE_TO_ARCH = {
    **{model_type: family.architectures[0] for model_type, family in FAMILIES.items()},
    "gpt2": "GPT2LMHeadModel",
    "opt": "OPTForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return list(_MODELS)


def _unsupported(what: str, model_type: str = "") -> ValueError:
    reason = unsupported_reason(model_type)
    return ValueError(f"Model architecture {what} is not supported. Supported architectures: {', '.join(_MODELS)}."
                      + (f" {reason}." if reason else ""))


def resolve_architecture(hf_config: Any) -> str:
    """The architecture name a config declares (``architectures[0]``, else from ``model_type``); validated."""
    archs = getattr(hf_config, "architectures", None) or []
    model_type = getattr(hf_config, "model_type", "")
    arch = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(model_type, "")
    if arch not in _MODELS:
        raise _unsupported(arch or f"model_type={model_type!r}", model_type)
    if _MODELS[arch][0] == "decoder" and model_type not in FAMILIES:
        # The class name alone is not enough: the decoder reads the family from model_type.
        raise _unsupported(f"{arch} (model_type={model_type!r})", model_type)
    return arch


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise _unsupported(repr(architecture))
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"pagedllm.models.{module_name}")
    return getattr(module, class_name)


def kv_cache_spec(model_config: ModelConfig, num_kv_heads: int | None = None,
                  kv_cache_format: KVCacheFormat = AUTO) -> KVCacheSpec:
    """The spec the model's class declares, else K and V of ``num_kv_heads`` heads (this rank's under
    tensor parallelism). ValueError for a quantized ``kv_cache_format`` with a latent cache: the
    quantized formats and their kernels read per-head K and V rows."""
    declared = getattr(get_model_class(model_config.architecture), "kv_cache_spec", None)
    if declared is None:
        return KVCacheSpec(2, num_kv_heads or model_config.num_kv_heads, model_config.head_dim)
    spec: KVCacheSpec = declared(model_config.hf_config)
    if spec.is_latent and kv_cache_format.quantized:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_format.name!r} is not supported for {model_config.architecture}, whose cache "
            "holds one latent row per token (multi-head latent attention); use kv_cache_dtype='auto'."
        )
    return spec
