"""Our C++ CPU kernels, built with torch's cpp_extension: paged decode attention, paged attention
over mixed batches (decodes and prompt chunks), greedy choice, linear layers over packed
quantized weights and over panel-packed float weights (pagedllm/models/cpu_gemm.py), the decoder's
fused elementwise chains (pagedllm/models/fused_ops.py).

Built once per machine (about a minute; ``scripts/install.sh`` does it at install time), cached
by torch under ``TORCH_EXTENSIONS_DIR``. If it cannot be built (no compiler, no ninja), the
torch-native path in backend.py runs instead; it stays the reference either way.
Set ``PAGEDLLM_CPU_KERNEL=0`` to force the torch-native path.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time

import torch

logger = logging.getLogger(__name__)

_SOURCES = [
    os.path.join(os.path.dirname(__file__), "csrc", name)
    for name in (
        "paged_attention_cpu.cpp",
        "chunked_attention_cpu.cpp",
        "prompt_attention_amx.cpp",
        "kv_cache_cpu.cpp",
        "greedy_cpu.cpp",
        "token_mask_cpu.cpp",
        "quant_linear_cpu.cpp",
        "quant_int8_cpu.cpp",
        "fused_ops_cpu.cpp",
        "dense_gemm_cpu.cpp",
        "layer_stack_cpu.cpp",
        "bindings.cpp",
    )
]
_HEADERS = [
    os.path.join(os.path.dirname(__file__), "csrc", name)
    for name in ("quant_formats.h", "vec_math.h", "amx_tiles.h", "work_order.h", "kernels.h")
]
_lock = threading.Lock()


def _build_name() -> str:
    """The extension's name carries a digest of its sources and of this CPU's feature flags: two
    checkouts (or a CPU with other instructions, built with -march=native) never share a build."""
    digest = hashlib.sha256()
    for path in _SOURCES + _HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read())
    try:
        with open("/proc/cpuinfo", "rb") as f:
            digest.update(next((line for line in f if line.startswith(b"flags")), b""))
    except OSError:
        pass
    return f"pagedllm_cpu_kernels_{digest.hexdigest()[:12]}"

_module = None
_failed = False
# A build takes one to three minutes; a lock older than this was left by a build that was killed,
# and torch would wait on it forever.
_STALE_LOCK_SECONDS = 15 * 60


def _remove_stale_build_lock(name: str) -> None:
    from torch.utils.cpp_extension import _get_build_directory

    lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return  # no lock: nobody is building
    if age > _STALE_LOCK_SECONDS:
        logger.warning("Removing a stale CPU kernel build lock (%.0f min old): %s", age / 60, lock)
        with contextlib.suppress(OSError):
            os.remove(lock)


def load_cpu_kernels(verbose: bool = False):
    """The compiled module, or None when it is disabled or cannot be built here."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        if os.environ.get("PAGEDLLM_CPU_KERNEL", "1") == "0":
            _failed = True
            return None
        try:
            from torch.utils.cpp_extension import load

            name = _build_name()
            _remove_stale_build_lock(name)
            _module = load(
                name=name,
                sources=_SOURCES,
                extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=verbose,
            )
        except Exception as exc:  # a missing toolchain must not take the engine down
            logger.warning("CPU kernels unavailable (%s); using the torch-native paths.", exc)
            _failed = True
    return _module


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
) -> torch.Tensor | None:
    """[B, Hq, D] attention output, or None when the kernel cannot serve this call.

    ``sliding_window`` > 0: only each sequence's last that many positions are attended;
    ``logits_soft_cap`` > 0: scores become cap * tanh(score / cap) before the softmax."""
    if query.device.type != "cpu":
        return None
    module = load_cpu_kernels()
    if module is None:
        return None
    return module.paged_decode_attention(
        query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, logits_soft_cap
    )


def paged_chunked_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
) -> torch.Tensor | None:
    """[T, Hq, D] causal attention of every query token over its sequence's cached context and
    itself (the step's K/V already written), or None when the kernel cannot serve this call.

    ``sliding_window`` and ``logits_soft_cap`` as in ``paged_decode_attention`` (0: off)."""
    if query.device.type != "cpu":
        return None
    module = load_cpu_kernels()
    if module is None:
        return None
    return module.paged_chunked_attention(
        query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, sliding_window, logits_soft_cap
    )


def prompt_attention_amx_supported(query: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether ``prompt_attention_amx`` runs for these queries and cache here: bfloat16 both, on a
    CPU with AMX, a head size that is a multiple of 64 (at most 256)."""
    if query.device.type != "cpu" or query.dtype != torch.bfloat16 or cache.dtype != torch.bfloat16:
        return False
    module = load_cpu_kernels()
    return module is not None and module.prompt_attention_amx_supported(query.shape[-1])


def prompt_attention_amx(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """[T, Hq, D] causal attention of prompt chunks over their cached context and themselves (the
    step's keys and values already written), on AMX tiles; only where
    ``prompt_attention_amx_supported``."""
    return load_cpu_kernels().prompt_attention_amx(
        query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale
    )


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row of float32 or bfloat16 ``[N, V]`` logits: (argmax ids, their raw logprobs as float32),
    or None (no kernel)."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16) or logits.shape[1] == 0:
        return None
    module = load_cpu_kernels()
    if module is None:
        return None
    return module.greedy_pick(logits)


if __name__ == "__main__":
    # `python -m pagedllm.attention.cpu_kernels` builds the kernel ahead of time.
    logging.basicConfig(level=logging.INFO)
    print("CPU kernels:", "built" if load_cpu_kernels(verbose=True) is not None else "unavailable")
