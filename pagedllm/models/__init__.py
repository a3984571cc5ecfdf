"""Model implementations (plain PyTorch) and the loader that finds configs, tokenizers and weights."""

from pagedllm.models.loader import build_model, load_model_config, load_tokenizer, resolve_model_path
from pagedllm.models.registry import get_model_class, resolve_architecture, supported_architectures

__all__ = [
    "build_model",
    "get_model_class",
    "load_model_config",
    "load_tokenizer",
    "resolve_architecture",
    "resolve_model_path",
    "supported_architectures",
]
