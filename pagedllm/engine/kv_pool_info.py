"""The KV pool described: its format and sizes, and how logs print them."""

from __future__ import annotations

from typing import Any

from pagedllm.config import CacheConfig, ModelConfig
from pagedllm.layers.parallel_layers import local_num_kv_heads
from pagedllm.worker.cache_engine import pool_block_bytes


def kv_cache_info(
    model_config: ModelConfig, cache_config: CacheConfig, num_gpu_blocks: int, num_cpu_blocks: int,
    tensor_parallel_size: int = 1,
    draft_model_config: ModelConfig | None = None,
) -> dict[str, Any]:
    """What the KV pool stores and how big it is, for the start-up log, get_stats(), /metrics and the dashboard.

    ``kv_cache_dtype`` is the setting ("auto", a 16-bit float type or a quantized format, canonical name);
    ``kv_cache_storage`` what a value is stored as (the model dtype for "auto"). Bytes are this
    rank's share under tensor parallelism (each rank holds its own KV heads); a draft model's layers,
    which share each block, are counted in.
    """
    fmt = cache_config.kv_cache_format
    num_kv_heads = local_num_kv_heads(model_config.num_kv_heads, tensor_parallel_size)
    # MLA's latent row and the draft's layers included.
    block_bytes = pool_block_bytes(model_config, cache_config, model_config.dtype, num_kv_heads, draft_model_config)
    per_token = block_bytes // cache_config.block_size
    return {
        "kv_cache_dtype": fmt.name,
        "kv_cache_storage": fmt.name if fmt.storage is not None else str(model_config.dtype).removeprefix("torch."),
        "kv_bytes_per_token": per_token,
        "kv_block_bytes": block_bytes,
        "kv_gpu_pool_bytes": block_bytes * num_gpu_blocks,
        "kv_cpu_pool_bytes": block_bytes * num_cpu_blocks,
        "block_size": cache_config.block_size,
        "tensor_parallel_size": tensor_parallel_size,
    }


def kv_dtype_label(info: dict[str, Any]) -> str:
    """The KV dtype as logs and pages show it: "int8", or "auto (bfloat16)" (the dtype "auto" stores)."""
    name = info["kv_cache_dtype"]
    return f"{name} ({info['kv_cache_storage']})" if name == "auto" else name


def format_bytes(num_bytes: float) -> str:
    """1536 -> "1.5 KiB"."""
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            break
        num_bytes /= 1024
    return f"{num_bytes:.0f} B" if unit == "B" else f"{num_bytes:.1f} {unit}"
