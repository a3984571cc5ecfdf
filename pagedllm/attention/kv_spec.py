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

from pagedllm.kv_cache_format import KVCacheFormat

if TYPE_CHECKING:
    pass


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

    def bytes_per_token(self, fmt: KVCacheFormat, num_layers: int, dtype: torch.dtype) -> int:
        """Bytes one token takes over all layers and pools, scales included."""
        if not self.is_latent:
            return fmt.bytes_per_token(self.head_dim, self.num_heads, num_layers, dtype.itemsize)
        return num_layers * self.num_heads * self.head_dim * fmt.value_bytes(dtype.itemsize)
