"""Attention backends. The torch-native one runs on CPU and CUDA alike."""

from pagedllm.attention.backend import AttentionMetadata, PagedAttention, gather_from_cache, write_to_cache

__all__ = ["AttentionMetadata", "PagedAttention", "gather_from_cache", "write_to_cache"]
