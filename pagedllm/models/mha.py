"""Plain multi-head attention of the learned-position models (GPT-2, OPT): q, k, v in one GEMM,
no rope, an output projection."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention import AttentionMetadata, PagedAttention
from pagedllm.layers.parallel_layers import QKVParallelLinear, RowParallelLinear


class MultiHeadAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, bias: bool, scale: float) -> None:
        super().__init__()
        self.head_dim = hidden // num_heads
        # Under tensor parallelism this rank computes only its heads.
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_heads, bias=bias)
        self.num_heads = self.qkv_proj.num_local_heads
        self.local_size = self.num_heads * self.head_dim
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias)
        self.attn = PagedAttention(self.num_heads, self.head_dim, self.num_heads, scale=scale)

    def forward(
        self, hidden: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor] | None, meta: AttentionMetadata | None
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.local_size, dim=-1)
        return self.out_proj(self.attn(q, k, v, kv_cache, meta))
