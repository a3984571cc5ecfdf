"""Kernel tests at every instruction-set level this CPU executes, each checking that the branch it
names is the one that ran.

The ``kernel_level`` fixture (conftest.py) runs a test once per level: the CPU's best level and
every level below it, capped by ``PAGEDLLM_CPU_ISA`` when that forces one. Inside, the kernels'
level is the parameter's, so models built there take that build's kernels; ``assert_ran(kernel)``
asserts that ``kernel`` ran since the test began and that its branch is the one this level
compiles (``EXPECTED_BRANCHES``, written from the levels' definitions in pagedllm/kernels/isa.py,
not read back from the build: a build that fell back to another branch fails here).

The levels are known from the CPU, so collecting builds nothing; a level is built when a test first
enters it, and a build that fails fails that test with the compiler's reason. ``@pytest.mark.kernels``
(``kernels(level="amx")``) marks a test that needs the kernels at the active level (conftest.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType

import pytest
from requirements_here import KERNELS_OFF

from pagedllm.kernels import kernel_config, use_kernel_config
from pagedllm.kernels.dispatch import build_error, cpu_kernels, module_for
from pagedllm.kernels.isa import LEVELS, level_index, resolve_level, runnable_levels

# The reason prefix of a skip for a level above this CPU's (or the forced) one: not a missing
# feature, but listed in the terminal summary too.
NOT_ON_THIS_CPU = "not on this CPU"


def _per_level(scalar: str, avx2: str, avx512: str, avx512_bf16: str, amx: str) -> dict[str, str]:
    return dict(zip(LEVELS, (scalar, avx2, avx512, avx512_bf16, amx), strict=True))


# "none": the build has no such kernel, and its callers take another path (oneDNN, torch).
EXPECTED_BRANCHES = {
    "paged_decode_attention": _per_level("scalar", "avx2", "avx512", "avx512", "avx512"),
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
    """The levels the kernel tests run at: every level this CPU runs, up to a forced one. Known from
    the CPU alone, without building: a level whose build fails fails its tests (``level_module``),
    and with the kernels off (``PAGEDLLM_CPU_KERNEL=0``) they skip, saying so."""
    top = resolve_level(kernel_config().isa)
    return [level for level in runnable_levels() if level_index(level) <= level_index(top)]


def level_runs_here(level: str) -> bool:
    """Whether the kernels' active level (this CPU's best, or the forced one) includes ``level``,
    read from the CPU without building."""
    return level_index(resolve_level(kernel_config().isa)) >= level_index(level)


def level_module(level: str) -> ModuleType:
    """The build of ``level``, built on first use: a skip when the run turned the kernels off, a
    failure with the compiler's reason when it does not build."""
    if not kernel_config().cpu_kernels:
        pytest.skip(KERNELS_OFF)
    module = module_for(level)
    if module is None:
        pytest.fail(f"the {level} CPU kernels did not build: {build_error(level)}", pytrace=False)
    return module


def check_kernels_mark(level: str | None) -> None:
    """What ``@pytest.mark.kernels`` (or ``kernels(level=...)``) asks before a test: the kernels on
    (else a skip), the active level at least ``level`` (else a skip: the CPU lacks it), its build
    loaded (else a failure)."""
    if not kernel_config().cpu_kernels:
        pytest.skip(KERNELS_OFF)
    active = resolve_level(kernel_config().isa)
    if level is not None and not level_runs_here(level):
        pytest.skip(f"{NOT_ON_THIS_CPU}: needs the {level} level, the kernels run at {active}")
    level_module(active)


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
    module = level_module(level)
    with use_kernel_config(isa=level):
        assert cpu_kernels() is module and module.ISA == level, f"the {level} build is not the one loaded"
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
