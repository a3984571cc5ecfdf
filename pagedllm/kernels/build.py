"""Compiling the CPU kernels (kernels/csrc) once per instruction-set level, with torch's cpp_extension.

Each level's build is a Python module of its own, ``pagedllm_kernels_<level>_<digest>``: the same
sources compiled with that level's flags (kernels/isa.py) and ``-DPAGEDLLM_ISA=<level>``. The
digest covers the sources, their folder, the flags and torch's version, so a change to any of them
builds anew and two checkouts never share a build; the CPU that compiled a build does not enter it (a
level's build runs on every CPU with the level's features). torch caches builds under
``TORCH_EXTENSIONS_DIR``. A build takes about a minute on two cores; ``scripts/install.sh`` builds
the levels this CPU runs ahead of time, and a level first used later is built then.

The kernel sources include ATen's headers rather than <torch/extension.h> (only bindings.cpp needs
pybind11 and the rest of the C++ frontend): that is 6 s of parsing per file instead of 23.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from types import ModuleType

from pagedllm.kernels.isa import compile_flags

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
SOURCES = [
    os.path.join(_CSRC, name)
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
        "branches.cpp",
        "bindings.cpp",
    )
]
HEADERS = [
    os.path.join(_CSRC, name)
    for name in (
        "quant_formats.h", "kv_formats.h", "vec_math.h", "amx_tiles.h", "work_order.h", "kernels.h", "branches.h"
    )
]
_BASE_FLAGS = ["-O3", "-ffast-math", "-fopenmp"]
# A build takes one to three minutes; a lock older than this was left by a build that was killed,
# and torch would wait on it forever.
_STALE_LOCK_SECONDS = 15 * 60


def cflags(level: str) -> list[str]:
    return [*_BASE_FLAGS, *compile_flags(level), f"-DPAGEDLLM_ISA={level}"]


def build_name(level: str) -> str:
    import torch

    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(" ".join(cflags(level)).encode())
    digest.update(torch.__version__.encode())
    # torch's build files name the sources by path: two checkouts sharing a name would rebuild it
    # in turn, each time the other one loads.
    digest.update(_CSRC.encode())
    return f"pagedllm_kernels_{level}_{digest.hexdigest()[:12]}"


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


def build_level(level: str, verbose: bool = False) -> ModuleType:
    """The compiled module of one level (built now unless torch's cache has it). Raises when the
    toolchain cannot build it."""
    from torch.utils.cpp_extension import load

    name = build_name(level)
    _remove_stale_build_lock(name)
    return load(name=name, sources=SOURCES, extra_cflags=cflags(level), extra_ldflags=["-fopenmp"], verbose=verbose)
