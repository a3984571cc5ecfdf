"""HF ``architectures[0]`` -> our model class."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# architecture name -> (module under pagedllm.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
}
# For configs saved without ``architectures`` (e.g. a bare LlamaConfig).
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "opt": "OPTForCausalLM",
}


def supported_architectures() -> list[str]:
    return list(_MODELS)


def resolve_architecture(hf_config: Any) -> str:
    """The architecture name a config declares (``architectures[0]``, else from ``model_type``); validated."""
    archs = getattr(hf_config, "architectures", None) or []
    arch = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(getattr(hf_config, "model_type", ""), "")
    if arch not in _MODELS:
        shown = arch or f"model_type={getattr(hf_config, 'model_type', None)!r}"
        raise ValueError(
            f"Model architecture {shown} is not supported. Supported architectures: {', '.join(_MODELS)}."
        )
    return arch


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"Model architecture {architecture!r} is not supported. Supported architectures: {', '.join(_MODELS)}."
        )
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"pagedllm.models.{module_name}")
    return getattr(module, class_name)
