"""What a model's paged KV cache holds per token and layer, as the model declares it.

Most models store a key and a value per KV head (two pools per layer). A model may declare
another layout through a ``kv_cache_spec(hf_config)`` static method on its class: DeepSeek's
multi-head latent attention stores one latent row per token (the compressed KV and the shared
rope key), in one pool per layer. The cache engine allocates what the spec says and sizes the
pool by its bytes per token, so ``kv_cache_memory`` buys the right number of blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.attention.kv_quant import kv_bytes_per_token, kv_format

if TYPE_CHECKING:
    from pagedllm.config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    """Per layer: ``num_pools`` pools (2: K and V; 1: one latent row) of ``[num_blocks, block_size,
    num_heads, head_dim]``."""

    num_pools: int
    num_heads: int
    head_dim: int

    @property
    def is_latent(self) -> bool:
        return self.num_pools == 1

    def bytes_per_token(self, kv_cache_dtype: str, num_layers: int, dtype: torch.dtype) -> int:
        """Bytes one token takes over all layers and pools, scales included."""
        fmt = kv_format(kv_cache_dtype)
        if not self.is_latent:
            return kv_bytes_per_token(fmt, self.head_dim, self.num_heads, num_layers, dtype)
        return num_layers * self.num_heads * self.head_dim * dtype.itemsize


def kv_cache_spec(model_config: ModelConfig, num_kv_heads: int | None = None,
                  kv_cache_dtype: str = "auto") -> KVCacheSpec:
    """The spec the model's class declares, else K and V of ``num_kv_heads`` heads (this rank's under
    tensor parallelism). ValueError for a quantized ``kv_cache_dtype`` with a latent cache: the
    quantized formats and their kernels read per-head K and V rows."""
    from pagedllm.models.registry import get_model_class  # models import attention: not at module level

    declared = getattr(get_model_class(model_config.architecture), "kv_cache_spec", None)
    if declared is None:
        return KVCacheSpec(2, num_kv_heads or model_config.num_kv_heads, model_config.head_dim)
    spec: KVCacheSpec = declared(model_config.hf_config)
    if spec.is_latent and kv_format(kv_cache_dtype) is not None:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported for {model_config.architecture}, whose cache "
            "holds one latent row per token (multi-head latent attention); use kv_cache_dtype='auto'."
        )
    return spec
