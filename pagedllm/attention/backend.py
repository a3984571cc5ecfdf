"""PagedAttention, torch-native backend: runs unchanged on CPU and CUDA.

KV cache layout per layer: ``k_cache`` and ``v_cache`` shaped
``[num_blocks, block_size, num_kv_heads, head_dim]``. A token's slot is
``block_table[pos // block_size] * block_size + pos % block_size``; viewing the cache as
``[num_blocks * block_size, num_kv_heads, head_dim]`` makes the slot a row index, so the
"reshape and write into the cache" step is a single ``index_copy_``.

Reads go through the block table every step. On CPU a decode step runs our C++ kernel
(attention/csrc), which reads each sequence's blocks in place; elsewhere, or when the kernel is
unavailable, the torch-native path gathers the blocks into a temporary tensor for that step
only. Nothing contiguous is kept between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.cpu_kernels import paged_decode_attention


@dataclass
class AttentionMetadata:
    """Per-step batch description shared by every layer (built once by the model runner)."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] int64
    query_lens: list[int]  # per sequence: tokens computed this step
    query_start_loc: list[int]  # [B + 1] cumulative query lengths
    context_lens: torch.Tensor  # [B] int64 (device): cached + new tokens after this step
    block_tables: torch.Tensor  # [B, max_blocks] int64 (device), padded with 0
    num_cached_tokens: list[int]  # per sequence: tokens already in the cache before this step
    max_context_len: int
    # Filled lazily by the first layer that needs it, then reused by all others.
    decode_mask: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


def write_to_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's keys/values ([T, Hkv, D]) into their slots."""
    num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_from_cache(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, length, Hkv, D] token states in logical order."""
    batch = block_tables.shape[0]
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    gathered = cache[block_tables[:, :num_blocks]]  # [B, nb, bs, Hkv, D]
    return gathered.view(batch, num_blocks * block_size, cache.shape[2], cache.shape[3])[:, :length]


class PagedAttention(nn.Module):
    """Multi-head / grouped-query attention over a paged KV cache."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        # The fused C++ kernel reads blocks in place on CPU; tests switch it off to compare paths.
        self.use_cpu_kernel = True

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        meta: AttentionMetadata | None,
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        if kv_cache is not None:
            write_to_cache(key, value, kv_cache[0], kv_cache[1], meta.slot_mapping)
        if meta is None or meta.is_prefill or kv_cache is None:
            out = self._prefill(query, key, value, kv_cache, meta)
        else:
            out = self._decode(query, kv_cache, meta)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        meta: AttentionMetadata | None,
    ) -> torch.Tensor:
        """Causal attention per prompt; a prompt with cached prefix blocks also reads those."""
        if meta is None:  # profiling run: the whole batch is one sequence
            starts, cached = [0, query.shape[0]], [0]
        else:
            starts, cached = meta.query_start_loc, meta.num_cached_tokens
        out = torch.empty_like(query)
        for i in range(len(starts) - 1):
            start, end = starts[i], starts[i + 1]
            q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            if cached[i] == 0:
                k = key[start:end].transpose(0, 1).unsqueeze(0)
                v = value[start:end].transpose(0, 1).unsqueeze(0)
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                total = cached[i] + (end - start)
                table = meta.block_tables[i : i + 1]
                k = gather_from_cache(kv_cache[0], table, total).transpose(1, 2)
                v = gather_from_cache(kv_cache[1], table, total).transpose(1, 2)
                # Query j sits at absolute position cached + j and sees keys 0..cached + j.
                q_pos = torch.arange(cached[i], total, device=query.device).unsqueeze(1)
                k_pos = torch.arange(total, device=query.device).unsqueeze(0)
                mask = k_pos <= q_pos
                attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[start:end] = attn.squeeze(0).transpose(0, 1)
        return out

    def _decode(
        self, query: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """One query per sequence, attending over all of its blocks."""
        if self.use_cpu_kernel:
            out = paged_decode_attention(
                query, kv_cache[0], kv_cache[1], meta.block_tables, meta.context_lens, self.scale
            )
            if out is not None:
                return out
        length = meta.max_context_len
        k = gather_from_cache(kv_cache[0], meta.block_tables, length).transpose(1, 2)  # [B, Hkv, L, D]
        v = gather_from_cache(kv_cache[1], meta.block_tables, length).transpose(1, 2)
        if meta.decode_mask is None:
            positions = torch.arange(length, device=query.device)
            meta.decode_mask = (positions.unsqueeze(0) < meta.context_lens.unsqueeze(1))[:, None, None, :]
        q = query.unsqueeze(2)  # [B, H, 1, D]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=True)
        return attn.squeeze(2)
