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

A layer with a sliding window W lets the query at position p see keys p - W + 1 .. p only; the
block manager may then have released blocks wholly before every layer's window, and their
table entries point at block 0: such positions are never read by the kernel and are masked out
in the torch paths. Attention soft-capping (Gemma 2) squashes the scores with cap * tanh(s / cap)
before the softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # Filled lazily by the first layer that needs one (per sliding window; 0: none), reused by the others.
    decode_masks: dict[int, torch.Tensor] = field(default_factory=dict)

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

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}.")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
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
            total = cached[i] + (end - start)
            if cached[i] == 0:
                k = key[start:end].transpose(0, 1).unsqueeze(0)
                v = value[start:end].transpose(0, 1).unsqueeze(0)
            else:
                table = meta.block_tables[i : i + 1]
                k = gather_from_cache(kv_cache[0], table, total).transpose(1, 2)
                v = gather_from_cache(kv_cache[1], table, total).transpose(1, 2)
            window = self.sliding_window
            if cached[i] == 0 and (window is None or window >= total) and self.logits_soft_cap is None:
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                # Query j sits at absolute position cached + j and sees keys max(0, pos - W + 1) .. pos.
                q_pos = torch.arange(cached[i], total, device=query.device).unsqueeze(1)
                k_pos = torch.arange(total, device=query.device).unsqueeze(0)
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
                attn = self._attend(q, k, v, mask)
            out[start:end] = attn.squeeze(0).transpose(0, 1)
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T * scale [soft-capped], masked) v over [B, H, q, D] / [B, Hkv, L, D]."""
        if self.logits_soft_cap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        cap = self.logits_soft_cap
        scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * (self.scale / cap)) * cap
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)

    def _decode(
        self, query: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """One query per sequence, attending over its blocks (the last W positions with a window)."""
        if self.use_cpu_kernel:
            out = paged_decode_attention(
                query, kv_cache[0], kv_cache[1], meta.block_tables, meta.context_lens, self.scale,
                self.sliding_window or 0, self.logits_soft_cap or 0.0,
            )
            if out is not None:
                return out
        length = meta.max_context_len
        k = gather_from_cache(kv_cache[0], meta.block_tables, length).transpose(1, 2)  # [B, Hkv, L, D]
        v = gather_from_cache(kv_cache[1], meta.block_tables, length).transpose(1, 2)
        window = self.sliding_window or 0
        mask = meta.decode_masks.get(window)
        if mask is None:
            positions = torch.arange(length, device=query.device).unsqueeze(0)
            context_lens = meta.context_lens.unsqueeze(1)
            mask = positions < context_lens
            if window:
                mask &= positions >= context_lens - window
            mask = meta.decode_masks[window] = mask[:, None, None, :]
        return self._attend(query.unsqueeze(2), k, v, mask).squeeze(2)
