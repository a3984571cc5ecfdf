"""Compiling the CPU kernels (kernels/csrc) once per instruction-set level, with torch's cpp_extension.

Each level's build is a Python module of its own, ``pagedllm_kernels_<level>_<digest>``: the same
sources compiled with that level's flags (kernels/isa.py) and ``-DPAGEDLLM_ISA=<level>``. The
digest covers everything that changes the build's output or the commands torch writes into its
``build.ninja``: the sources and their real folder, the flags, torch's version, include and library
paths, Python's include path, ``sys.prefix`` and the compiler (``CXX``, its path and version). So a
change to any of them builds anew, and two checkouts or two environments of one checkout never
rebuild each other's builds in place; a checkout reached through a symlink shares its build (the
sources are handed to torch by their real path). The CPU that compiled a build does not enter it (a
level's build runs on every CPU with the level's features). torch caches builds under
``TORCH_EXTENSIONS_DIR``. A build takes one to three minutes on two cores; ``scripts/install.sh``
builds the levels this CPU runs ahead of time, and a level first used later is built then.

The flags keep IEEE semantics: no ``-ffast-math`` (its ``-ffinite-math-only`` lets the compiler
drop the kernels' infinity sentinels and NaN tests). ``-fno-math-errno`` and ``-fno-trapping-math``
are safe (no errno, no FP traps) and let calls such as sqrt inline; reductions vectorise through
``#pragma omp simd reduction``, and libmvec's vector exp/tanh/erf are declared in csrc/vec_math.h.
benchmarks/fast_math_cost.py measures what -ffast-math would still buy.

The kernel sources include ATen's headers rather than <torch/extension.h> (only bindings.cpp needs
pybind11 and the rest of the C++ frontend): that is 6 s of parsing per file instead of 23.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Sequence
from types import ModuleType

from pagedllm.kernels.isa import compile_flags

logger = logging.getLogger(__name__)

# The real path: torch writes the sources' paths into build.ninja, and a checkout reached through a
# symlink would otherwise rebuild in turn with the same checkout reached directly.
CSRC = os.path.join(os.path.realpath(os.path.dirname(__file__)), "csrc")
_SOURCE_NAMES = (
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
_HEADER_NAMES = (
    "quant_formats.h", "kv_formats.h", "vec_math.h", "amx_tiles.h", "work_order.h", "kernels.h", "branches.h",
    "attention_sinks.h",
)


def sources(csrc: str = CSRC) -> list[str]:
    """The C++ sources torch compiles, by their real path."""
    folder = os.path.realpath(csrc)
    return [os.path.join(folder, name) for name in _SOURCE_NAMES]


def headers(csrc: str = CSRC) -> list[str]:
    folder = os.path.realpath(csrc)
    return [os.path.join(folder, name) for name in _HEADER_NAMES]


SOURCES = sources()
HEADERS = headers()
BASE_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp")
# What the kernels were built with before: only for benchmarks/fast_math_cost.py, which measures it.
FAST_MATH_FLAGS = ("-O3", "-ffast-math", "-fopenmp")
# A build takes one to three minutes; a lock older than this was left by a build that was killed,
# and torch would wait on it forever.
_STALE_LOCK_SECONDS = 15 * 60


def cflags(level: str, base_flags: Sequence[str] = BASE_FLAGS) -> list[str]:
    return [*base_flags, *compile_flags(level), f"-DPAGEDLLM_ISA={level}"]


@functools.cache
def _compiler_identity(cxx: str) -> str:
    """The compiler torch runs (``CXX``, else ``c++``): its resolved path and ``--version``. An
    upgraded compiler at the same path changes the version line; a broken one answers nothing."""
    path = shutil.which(cxx)
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        version = done.stdout.splitlines()[0] if done.returncode == 0 and done.stdout else ""
    except (OSError, subprocess.SubprocessError):
        version = ""
    return f"{cxx}|{os.path.realpath(path) if path else ''}|{version}"


def toolchain() -> list[str]:
    """Everything outside the sources and flags that enters a build: the paths torch writes into
    build.ninja (its include and library folders, Python's include folder), the environment, the
    compiler."""
    import torch
    from torch.utils.cpp_extension import get_cxx_compiler, include_paths, library_paths

    return [
        torch.__version__,
        *include_paths(),
        *library_paths(),
        sysconfig.get_path("include", scheme="posix_prefix") or "",
        sys.prefix,
        _compiler_identity(get_cxx_compiler()),
    ]


def build_name(level: str, base_flags: Sequence[str] = BASE_FLAGS, csrc: str = CSRC) -> str:
    digest = hashlib.sha256()
    for path in sources(csrc) + headers(csrc):
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(" ".join(cflags(level, base_flags)).encode())
    # torch's build files name the sources and the include folders by path: two builds sharing a
    # name with different paths would rebuild it in turn, each time the other one loads.
    digest.update(os.path.realpath(csrc).encode())
    for part in toolchain():
        digest.update(b"\0" + part.encode())
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


@contextlib.contextmanager
def _pinned_ninja():
    """torch runs the ``ninja`` first on PATH. Two ninja versions hash a command differently in a build
    folder's .ninja_log, so a build made by one is rebuilt whole by the other (the system's ninja for
    one process, the pinned ``ninja`` package's for another whose PATH starts with the environment's
    bin folder). Every build runs the pinned package's ninja, whatever PATH holds."""
    try:
        import ninja
    except ImportError:  # not installed: the ninja on PATH, as torch would take it
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


def build_level(level: str, verbose: bool = False, base_flags: Sequence[str] = BASE_FLAGS) -> ModuleType:
    """The compiled module of one level (built now unless torch's cache has it). Raises when the
    toolchain cannot build it. Other ``base_flags`` (a benchmark's) build under a name of their own."""
    from torch.utils.cpp_extension import load

    name = build_name(level, base_flags)
    _remove_stale_build_lock(name)
    with _pinned_ninja():
        return load(name=name, sources=SOURCES, extra_cflags=cflags(level, base_flags), extra_ldflags=["-fopenmp"],
                    verbose=verbose)
