"""The kernels' instruction-set levels (pagedllm/kernels): detection, forcing, the settings, and
``pagedllm env`` reporting, at each level this CPU runs, the branch every kernel compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
from kernel_levels import EXPECTED_BRANCHES, levels_here

from pagedllm import LLM
from pagedllm.kernels import KernelConfig, cpu_kernels, kernel_config, use_kernel_config
from pagedllm.kernels.codes import check_codes
from pagedllm.kernels.isa import (
    LEVELS,
    best_level,
    compile_flags,
    is_x86,
    missing_features,
    required_features,
    resolve_level,
    runnable_levels,
)

AVX2 = frozenset({"avx2", "fma", "f16c"})
ZEN5 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}


def test_levels_from_cpu_features() -> None:
    assert best_level(frozenset()) == "scalar"
    assert best_level(AVX2 - {"fma"}) == "scalar"
    assert best_level(AVX2) == "avx2"
    assert best_level(ZEN5 - {"avx512_vnni"}) == "avx512"
    assert best_level(ZEN5) == "avx512_bf16"
    assert best_level(ZEN5 | {"amx_tile", "amx_bf16", "amx_int8"}) == "amx"
    assert runnable_levels(ZEN5) == ("scalar", "avx2", "avx512", "avx512_bf16")
    assert missing_features("amx", ZEN5) == ["amx_tile", "amx_bf16", "amx_int8"]
    # Each level's features include the ones below it.
    for lower, higher in zip(LEVELS, LEVELS[1:]):
        assert set(required_features(lower)) < set(required_features(higher))


@pytest.mark.skipif(not is_x86(), reason="x86 levels")
def test_each_level_adds_compiler_flags() -> None:
    flags = [compile_flags(level) for level in LEVELS]
    assert flags[0] == ["-march=x86-64", "-mtune=generic"]  # no -march=native: a build runs on any CPU of its level
    for lower, higher in zip(flags, flags[1:]):
        assert lower == higher[: len(lower)] and len(higher) > len(lower)
    assert "-mamx-tile" in flags[-1] and "-mavx512bf16" in flags[3] and "-mavx2" in flags[1]


def test_forcing_a_level_this_cpu_lacks_is_refused_naming_what_it_lacks() -> None:
    assert resolve_level("auto") == best_level()
    for level in runnable_levels():
        assert resolve_level(level) == level
    above = LEVELS[len(runnable_levels()):]
    if not above:
        pytest.skip("this CPU runs every level")
    lacking = missing_features(above[0])[0]
    with pytest.raises(ValueError, match=f"PAGEDLLM_CPU_ISA={above[0]}: this CPU .* lacks {lacking}"):
        resolve_level(above[0])
    with use_kernel_config(isa=above[0]), pytest.raises(ValueError, match="lacks"):
        LLM(num_kv_blocks=8)


def test_kernel_settings_are_checked_and_scoped() -> None:
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_ISA='avx3'"):
        KernelConfig(isa="avx3")
    with pytest.raises(ValueError, match="PAGEDLLM_INT8_AMX_MIN_ROWS"):
        KernelConfig.from_env({"PAGEDLLM_INT8_AMX_MIN_ROWS": "many"})
    with pytest.raises(ValueError, match="PAGEDLLM_QUANT_KERNEL"):
        KernelConfig.from_env({"PAGEDLLM_QUANT_KERNEL": "asm"})
    config = KernelConfig.from_env({"PAGEDLLM_CPU_ISA": "AVX2", "PAGEDLLM_LAYER_STACK": "0",
                                    "PAGEDLLM_CPU_GEMM": "onednn"})
    assert (config.isa, config.layer_stack, config.gemm, config.cpu_kernels) == ("avx2", False, "onednn", True)
    assert KernelConfig.from_env(config.to_env()) == config
    before = kernel_config()
    with use_kernel_config(cpu_kernels=False):
        assert cpu_kernels() is None
    assert kernel_config() == before


def test_codes_are_checked_against_the_build() -> None:
    module = cpu_kernels()
    if module is None:
        pytest.skip("no CPU kernels here")
    check_codes(module)
    wrong = types.SimpleNamespace(CODES={**module.CODES, "PANEL": 7})
    with pytest.raises(RuntimeError, match="codes"):
        check_codes(wrong)


def _env_json(level: str | None) -> tuple[int, dict]:
    env = {**os.environ, "PAGEDLLM_CPU_ISA": level or "auto"}
    done = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "env", "--json"], env=env,
                          capture_output=True, text=True, timeout=120)
    return done.returncode, json.loads(done.stdout)


@pytest.mark.parametrize("level", levels_here())
def test_env_reports_each_level_and_its_branches(level: str) -> None:
    """``PAGEDLLM_CPU_ISA=<level> pagedllm env --json``: that level, and per kernel the branch that
    level compiles (what the kernel tests at that level assert ran)."""
    code, report = _env_json(level)
    assert code == 0 and report["kernels"] == "built", report
    assert report["level"] == level and report["settings"]["isa"] == level
    assert {name: b["branch"] for name, b in report["branches"].items()} == {
        name: branches[level] for name, branches in EXPECTED_BRANCHES.items()
    }


def test_env_explains_a_refused_level() -> None:
    above = LEVELS[len(runnable_levels()):]
    if not above:
        pytest.skip("this CPU runs every level")
    code, report = _env_json(above[0])
    assert code == 2 and report["level"] is None and report["kernels"] == "unavailable"
    assert "lacks" in report["kernels_reason"]
