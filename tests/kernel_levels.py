"""Kernel tests at every instruction-set level this CPU executes, each checking that the branch it
names is the one that ran.

The ``kernel_level`` fixture (conftest.py) runs a test once per level: the CPU's best level and
every level below it, capped by ``PAGEDLLM_CPU_ISA`` when that forces one. Inside, the kernels'
level is the parameter's, so models built there take that build's kernels; ``assert_ran(kernel)``
asserts that ``kernel`` ran since the test began and that its branch is the one this level
compiles (``EXPECTED_BRANCHES``, written from the levels' definitions in pagedllm/kernels/isa.py,
not read back from the build: a build that fell back to another branch fails here).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType

from pagedllm.kernels import kernel_config, use_kernel_config
from pagedllm.kernels.dispatch import cpu_kernels, module_for
from pagedllm.kernels.isa import LEVELS, level_index, resolve_level, runnable_levels


def _per_level(scalar: str, avx2: str, avx512: str, avx512_bf16: str, amx: str) -> dict[str, str]:
    return dict(zip(LEVELS, (scalar, avx2, avx512, avx512_bf16, amx), strict=True))


# "none": the build has no such kernel, and its callers take another path (oneDNN, torch).
EXPECTED_BRANCHES = {
    "paged_decode_attention": _per_level("scalar", "scalar", "avx512", "avx512", "avx512"),
    "paged_chunked_attention": _per_level("compiler", "compiler", "compiler", "compiler", "compiler"),
    "prompt_attention_amx": _per_level("none", "none", "none", "none", "amx"),
    "dense_gemm_f32": _per_level("none", "none", "avx512", "avx512", "avx512"),
    "dense_gemm_bf16": _per_level("none", "none", "none", "avx512_bf16", "avx512_bf16"),
    "dense_gemm_bf16_amx": _per_level("none", "none", "none", "none", "amx"),
    "quant_linear": _per_level("scalar", "avx2", "avx512", "avx512", "avx512"),
    # AVX-512 without VNNI multiplies int8 through AVX2's pmaddubsw; the scalar build has no int8 dot.
    "int8_linear_dot": _per_level("none", "avx2", "avx2", "avx512_vnni", "avx512_vnni"),
    "int8_linear_amx": _per_level("none", "none", "none", "none", "amx"),
    "fused_ops": _per_level("scalar", "scalar", "avx512", "avx512_bf16", "avx512_bf16"),
    "greedy_pick": _per_level("scalar", "scalar", "avx512", "avx512", "avx512"),
}


def levels_here() -> list[str]:
    """The levels the kernel tests run at: every level this CPU runs, up to a forced one; none
    when the kernels are off or cannot be built (the tests then skip, saying so)."""
    config = kernel_config()
    if not config.cpu_kernels:
        return []
    top = resolve_level(config.isa)
    levels = [level for level in runnable_levels() if level_index(level) <= level_index(top)]
    return [level for level in levels if module_for(level) is not None]


def at_least(level: str, minimum: str) -> bool:
    return level_index(level) >= level_index(minimum)


@dataclass
class KernelLevel:
    """The level a test runs at, its module, and the kernels' run counts when it began."""

    level: str
    module: ModuleType
    runs_before: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.runs_before = {name: runs for name, (_, runs) in self.module.kernel_branches().items()}

    def branch(self, kernel: str) -> str:
        return EXPECTED_BRANCHES[kernel][self.level]

    def has(self, kernel: str) -> bool:
        return self.branch(kernel) != "none"

    def runs(self, kernel: str) -> int:
        return self.module.kernel_branches()[kernel][1] - self.runs_before[kernel]

    def assert_ran(self, *kernels: str) -> None:
        branches = self.module.kernel_branches()
        for kernel in kernels:
            compiled, _ = branches[kernel]
            expected = self.branch(kernel)
            assert compiled == expected, f"{kernel} at {self.level}: built {compiled}, expected {expected}"
            assert compiled != "none", f"{kernel} has no branch at {self.level}"
            assert self.runs(kernel) > 0, f"{kernel} ({compiled}) did not run at {self.level}"

    def assert_not_ran(self, *kernels: str) -> None:
        for kernel in kernels:
            assert self.runs(kernel) == 0, f"{kernel} ran at {self.level}"


@contextlib.contextmanager
def enter_level(level: str) -> Iterator[KernelLevel]:
    """The kernels at ``level`` inside the block."""
    with use_kernel_config(isa=level):
        module = cpu_kernels()
        assert module is not None and module.ISA == level, f"no {level} build loaded"
        yield KernelLevel(level, module)


def kernel_paths() -> list[str]:
    """"torch" (the reference path, the one a GPU runs) and every level of ``levels_here``."""
    return ["torch", *levels_here()]


@contextlib.contextmanager
def at_path(path: str) -> Iterator[KernelLevel | None]:
    """Inside: the kernels at level ``path``, or off (None) for "torch"."""
    if path == "torch":
        with use_kernel_config(cpu_kernels=False):
            yield None
    else:
        with enter_level(path) as level:
            yield level
