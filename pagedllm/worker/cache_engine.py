"""The KV block pools: device pool for attention, CPU pool for swapped-out blocks.

All layers' K and V live in one tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads,
row]``; each layer sees two contiguous views ``[num_blocks, block_size, num_kv_heads, row]``. A row is
one head's ``head_dim`` values in the model dtype, or with ``kv_cache_dtype`` set, its quantized
values and their scales (attention/kv_quant.py; the pool's dtype names the format).
A model may declare another layout (attention/kv_spec.py): DeepSeek's latent attention has ONE
pool per layer, ``[num_layers, 1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``,
each layer seeing a one-view tuple; block moves are the same indexing either way.
A draft model (speculative decoding) has pools of its own with the same block count, addressed by
the same block ids: a block is one position range of both models, so every block move covers both.
Keeping the block axis shared by every layer lets one indexing operation copy (copy-on-write)
or swap a list of blocks for all layers at once, which is what the paper's fused
"copy many blocks in one launch" kernel does.
"""

from __future__ import annotations

import logging

import torch

from pagedllm.attention.kv_quant import pool_storage
from pagedllm.config import CacheConfig, ModelConfig
from pagedllm.kernels.huge_pages import huge_page_buffer, huge_pages_enabled
from pagedllm.kv_cache_format import AUTO, KVCacheFormat
from pagedllm.models.registry import kv_cache_spec

logger = logging.getLogger(__name__)

# Share of available host memory the KV pool may take when no size is given on CPU.
_CPU_DEFAULT_FRACTION = 0.25
_CPU_DEFAULT_CAP = 4 << 30
_GPU_MEMORY_UTILIZATION = 0.9


def kv_block_bytes(
    model_config: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None,
    kv_cache_format: KVCacheFormat = AUTO,
) -> int:
    """Bytes one physical block takes across all layers, K and V (or the latent row a model's spec
    declares), scales included (of this rank's KV heads under tensor parallelism)."""
    spec = kv_cache_spec(model_config, num_kv_heads, kv_cache_format)
    return block_size * spec.bytes_per_token(kv_cache_format, model_config.num_layers, dtype)


def pool_block_bytes(
    model_config: ModelConfig, cache_config: CacheConfig, dtype: torch.dtype, num_kv_heads: int | None = None,
    draft_model_config: ModelConfig | None = None,
) -> int:
    """Bytes of one block id across the pool: the target's layers, and the draft model's when there is one."""
    size = kv_block_bytes(model_config, cache_config.block_size, dtype, num_kv_heads, cache_config.kv_cache_format)
    if draft_model_config is not None:
        size += kv_block_bytes(draft_model_config, cache_config.block_size, dtype, None, cache_config.kv_cache_format)
    return size


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def decide_num_gpu_blocks(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    device: torch.device,
    dtype: torch.dtype,
    num_kv_heads: int | None = None,
    host_share: int = 1,
    draft_model_config: ModelConfig | None = None,
) -> int:
    """Explicit count, else a byte budget, else what free memory allows (measured after warm-up).

    num_kv_heads: this rank's KV heads (tensor parallelism); host_share: processes sharing this
    host's memory for their CPU pools (the default CPU budget is split between them);
    draft_model_config: a draft model whose layers share each block (speculative decoding).
    """
    if cache_config.num_kv_blocks is not None:
        return cache_config.num_kv_blocks
    block_bytes = pool_block_bytes(model_config, cache_config, dtype, num_kv_heads, draft_model_config)
    if cache_config.kv_cache_memory is not None:
        budget = cache_config.kv_cache_memory
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_elsewhere = total - free
        budget = int(total * _GPU_MEMORY_UTILIZATION) - used_elsewhere
    else:
        budget = min(int(available_host_memory() * _CPU_DEFAULT_FRACTION), _CPU_DEFAULT_CAP) // max(host_share, 1)
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"The KV cache budget ({budget} bytes) is smaller than one block ({block_bytes} bytes); "
            "raise kv_cache_memory or num_kv_blocks."
        )
    return num_blocks


def zeroed_kv_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The attention pool, zero-filled. On a CPU it lies in huge pages where they are enabled: decode
    attention reads each sequence's blocks scattered through the pool, and in 4 KB pages nearly every
    block costs TLB misses (float32, 19 sequences of 200 tokens, the default model's heads: 421 ->
    371 us a layer on a 2-core AMX VM; benchmarks/decode_attention.py)."""
    if device.type != "cpu" or not huge_pages_enabled():
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    # Touched now, as torch.zeros touches its pages: a huge page's first touch zeroes 2 MB (and may
    # compact memory to find them), which inside the steps that first write a block cost prefill
    # steps ~20% on a 2-core VM.
    return huge_page_buffer(nbytes).fill_(0).view(dtype).view(shape)


class CacheEngine:
    """Owns the pools and executes the block moves the scheduler decided."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        num_kv_heads: int | None = None,
        draft_model_config: ModelConfig | None = None,
    ) -> None:
        self.block_size = cache_config.block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.device = device
        self.kv_format = cache_config.kv_cache_format
        self.gpu_pool, self.cpu_pool, self.kv_caches = self._pools(model_config, num_kv_heads, dtype)
        pools = [(self.gpu_pool, self.cpu_pool)]
        self.draft_kv_caches: list[tuple[torch.Tensor, ...]] | None = None
        if draft_model_config is not None:
            draft_gpu, draft_cpu, self.draft_kv_caches = self._pools(draft_model_config, None, dtype)
            pools.append((draft_gpu, draft_cpu))
        # Block moves are byte copies whatever the format (torch has no indexing kernels for float8 on
        # every device); these views share the pools' memory.
        self._byte_views = [
            (gpu.view(torch.uint8), None if cpu is None else cpu.view(torch.uint8)) for gpu, cpu in pools
        ]

    def _pools(
        self, model_config: ModelConfig, num_kv_heads: int | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[tuple[torch.Tensor, ...]]]:
        """One model's device and CPU pools and, per layer, its views: (K, V), or (latent,) for a
        one-pool spec (K and V pools of num_kv_heads heads, or what the model declares: MLA's latent)."""
        spec = kv_cache_spec(model_config, num_kv_heads, self.kv_format)
        self.kv_format.check_head_dim(spec.head_dim)
        row = self.kv_format.pool_row(spec.head_dim)
        storage = pool_storage(self.kv_format, dtype)
        shape = (model_config.num_layers, spec.num_pools, 0, self.block_size, spec.num_heads, row)
        gpu_pool = zeroed_kv_pool(shape[:2] + (self.num_gpu_blocks,) + shape[3:], storage, self.device)
        pin = self.device.type == "cuda"
        cpu_shape = shape[:2] + (self.num_cpu_blocks,) + shape[3:]
        cpu_pool = torch.zeros(cpu_shape, dtype=storage, pin_memory=pin) if self.num_cpu_blocks else None
        kv_caches = [tuple(gpu_pool[layer, i] for i in range(spec.num_pools)) for layer in range(shape[0])]
        return gpu_pool, cpu_pool, kv_caches

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: every (src, dst) pair, all layers, K and V, in one indexing op."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for gpu_bytes, _ in self._byte_views:
            gpu_bytes[:, :, dst] = gpu_bytes[:, :, src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device blocks -> CPU blocks, (gpu, cpu) pairs, batched over all layers."""
        if not pairs:
            return
        src = torch.tensor([g for g, _ in pairs], device=self.device)
        dst = torch.tensor([c for _, c in pairs])
        for gpu_bytes, cpu_bytes in self._byte_views:
            cpu_bytes[:, :, dst] = gpu_bytes[:, :, src].to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """CPU blocks -> device blocks, (cpu, gpu) pairs, batched over all layers."""
        if not pairs:
            return
        src = torch.tensor([c for c, _ in pairs])
        dst = torch.tensor([g for _, g in pairs], device=self.device)
        for gpu_bytes, cpu_bytes in self._byte_views:
            gpu_bytes[:, :, dst] = cpu_bytes[:, :, src].to(self.device, non_blocking=True)
