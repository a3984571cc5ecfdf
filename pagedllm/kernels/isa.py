"""The instruction-set levels our CPU kernels are built for, and which of them this CPU runs.

The kernels choose their instructions at compile time, so each level is a build of its own
(kernels/build.py), with the compiler flags of that level rather than ``-march=native``: the build
for a level runs on every CPU that has the level's features, whichever machine compiled it.
Levels are ordered; each one adds features to the one below it:

- ``scalar``: no vector extensions assumed (the portable C++ loops; also the only level off x86);
- ``avx2``: AVX2, FMA and F16C (every x86 server since 2013: Haswell, Zen);
- ``avx512``: AVX-512 F/BW/VL/DQ (Skylake-SP, Zen 4);
- ``avx512_bf16``: and AVX-512 BF16 and VNNI (Cooper Lake, Zen 4 / 5);
- ``amx``: and AMX tiles for bfloat16 and int8 (Sapphire Rapids and later).

This module reads the CPU and never imports torch.
"""

from __future__ import annotations

import platform
from functools import cache

LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16", "amx")

# /proc/cpuinfo flag names each level needs, on top of the level below it.
_ADDED_FEATURES = {
    "scalar": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16", "avx512_vnni"),
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
}

# The compiler flags of each level's build, on top of the level below it.
_ADDED_FLAGS = {
    "scalar": (),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    "avx512_bf16": ("-mavx512bf16", "-mavx512vnni"),
    "amx": ("-mamx-tile", "-mamx-bf16", "-mamx-int8"),
}


# torch's own CPU kernels and oneDNN's at the same level (their variables ATEN_CPU_CAPABILITY and
# ONEDNN_MAX_CPU_ISA), so that a forced level runs as a CPU of that kind would.
_TORCH_CAPS = {
    "scalar": ("default", "SSE41"),
    "avx2": ("avx2", "AVX2"),
    "avx512": ("avx512", "AVX512_CORE"),
    "avx512_bf16": ("avx512", "AVX512_CORE_BF16"),
    "amx": ("avx512", "AVX512_CORE_AMX"),
}


def torch_caps(level: str) -> dict[str, str]:
    """The environment that holds torch's and oneDNN's kernels at ``level`` (read by torch when it
    loads and by oneDNN at its first use, so it only acts before either)."""
    aten, onednn = _TORCH_CAPS[level]
    return {"ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn}


def cap_torch_to_forced_level(env: dict[str, str] | None = None) -> None:
    """Where ``PAGEDLLM_CPU_ISA`` forces a level before torch is imported, hold torch's and oneDNN's
    kernels at it too (variables already set win)."""
    import os
    import sys

    env = os.environ if env is None else env
    level = env.get("PAGEDLLM_CPU_ISA", "auto").strip().lower()
    if level in _TORCH_CAPS and "torch" not in sys.modules and is_x86():
        for name, value in torch_caps(level).items():
            env.setdefault(name, value)


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def level_index(level: str) -> int:
    check_level_name(level)
    return LEVELS.index(level)


def check_level_name(level: str) -> None:
    if level not in LEVELS:
        raise ValueError(f"unknown CPU ISA level {level!r}: expected one of {', '.join(LEVELS)}")


def required_features(level: str) -> tuple[str, ...]:
    """Every CPU feature (as /proc/cpuinfo names it) a level's build executes."""
    features: list[str] = []
    for name in LEVELS[: level_index(level) + 1]:
        features += _ADDED_FEATURES[name]
    return tuple(features)


def compile_flags(level: str) -> list[str]:
    """The instruction-set flags of a level's build (x86: ``-march=x86-64`` plus each level's
    extensions; elsewhere the compiler's default target, the portable level only)."""
    if not is_x86():
        if level != "scalar":
            raise ValueError(f"the {level} kernels are x86 only; this machine is {platform.machine()}")
        return []
    flags = ["-march=x86-64", "-mtune=generic"]
    for name in LEVELS[: level_index(level) + 1]:
        flags += _ADDED_FLAGS[name]
    return flags


@cache
def cpu_features() -> frozenset[str]:
    """This CPU's feature flags as the kernel reports them (what the OS lets programs use)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@cache
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def missing_features(level: str, features: frozenset[str] | None = None) -> list[str]:
    """The features ``level`` needs that the CPU lacks (empty: it runs here)."""
    if not is_x86():
        return [] if level == "scalar" else [f"x86 ({platform.machine()} CPU)"]
    have = cpu_features() if features is None else features
    return [f for f in required_features(level) if f not in have]


def best_level(features: frozenset[str] | None = None) -> str:
    """The highest level this CPU runs."""
    best = "scalar"
    for level in LEVELS:
        if missing_features(level, features):
            break
        best = level
    return best


def runnable_levels(features: frozenset[str] | None = None) -> tuple[str, ...]:
    """Every level this CPU runs, lowest first."""
    return LEVELS[: level_index(best_level(features)) + 1]


def resolve_level(requested: str) -> str:
    """The level to run: ``auto`` is the best one here; a named level must be one this CPU runs,
    else a ValueError naming what the CPU lacks."""
    if requested == "auto":
        return best_level()
    check_level_name(requested)
    missing = missing_features(requested)
    if missing:
        raise ValueError(
            f"PAGEDLLM_CPU_ISA={requested}: this CPU ({cpu_model()}) lacks {', '.join(missing)}; "
            f"it runs {', '.join(runnable_levels())} (best: {best_level()})"
        )
    return requested
