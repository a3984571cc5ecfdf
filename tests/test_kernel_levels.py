"""The kernels' instruction-set levels (pagedllm/kernels): detection, forcing, the settings, and
``pagedllm env`` reporting, at each level this CPU runs, the branch every kernel compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch
from kernel_levels import EXPECTED_BRANCHES, NOT_ON_THIS_CPU, level_module, levels_here
from requirements_here import KERNELS_OFF, require_kernels

from pagedllm import LLM
from pagedllm.kernels import KernelConfig, build, cpu_kernels, kernel_config, use_kernel_config
from pagedllm.kernels.codes import check_codes
from pagedllm.kernels.dispatch import build_error, module_for
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

_TESTS = os.path.dirname(os.path.abspath(__file__))
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


@pytest.mark.skipif(not is_x86(), reason=f"{NOT_ON_THIS_CPU}: x86 levels")
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
        pytest.skip(f"{NOT_ON_THIS_CPU}: it runs every level")
    lacking = missing_features(above[0])[0]
    with pytest.raises(ValueError, match=f"PAGEDLLM_CPU_ISA={above[0]}: this CPU .* lacks {lacking}"):
        resolve_level(above[0])
    # Refused before anything is built, also in a run with the kernels off.
    with use_kernel_config(isa=above[0], cpu_kernels=True), pytest.raises(ValueError, match="lacks"):
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
    module = require_kernels()
    check_codes(module)
    wrong = types.SimpleNamespace(CODES={**module.CODES, "PANEL": 7})
    with pytest.raises(RuntimeError, match="codes"):
        check_codes(wrong)


def _env_json(level: str | None) -> tuple[int, dict]:
    # The kernels on: what ``env`` reports of a level (a refused one too), also in a run with them off.
    env = {**os.environ, "PAGEDLLM_CPU_ISA": level or "auto", "PAGEDLLM_CPU_KERNEL": "1"}
    done = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "env", "--json"], env=env,
                          capture_output=True, text=True, timeout=120)
    return done.returncode, json.loads(done.stdout)


@pytest.mark.parametrize("level", levels_here())
def test_env_reports_each_level_and_its_branches(level: str) -> None:
    """``PAGEDLLM_CPU_ISA=<level> pagedllm env --json``: that level, and per kernel the branch that
    level compiles (what the kernel tests at that level assert ran)."""
    level_module(level)  # built here first: a failed build fails with the compiler's reason
    code, report = _env_json(level)
    assert code == 0 and report["kernels"] == "built", report
    assert report["level"] == level and report["settings"]["isa"] == level
    assert {name: b["branch"] for name, b in report["branches"].items()} == {
        name: branches[level] for name, branches in EXPECTED_BRANCHES.items()
    }


def test_env_explains_a_refused_level() -> None:
    above = LEVELS[len(runnable_levels()):]
    if not above:
        pytest.skip(f"{NOT_ON_THIS_CPU}: it runs every level")
    code, report = _env_json(above[0])
    assert code == 2 and report["level"] is None and report["kernels"] == "unavailable"
    assert "lacks" in report["kernels_reason"]


def test_every_level_this_cpu_runs_builds() -> None:
    """Each level the kernel tests run at builds and loads here: one that does not fails the suite
    with the compiler's reason, rather than leaving its tests out."""
    if not kernel_config().cpu_kernels:
        pytest.skip(KERNELS_OFF)
    assert levels_here()[0] == "scalar" and levels_here()[-1] == resolve_level(kernel_config().isa)
    failed = {level: build_error(level) for level in levels_here() if module_for(level) is None}
    assert not failed, f"CPU kernel levels that did not build: {failed}"
    assert [module_for(level).ISA for level in levels_here()] == levels_here()


def test_build_name_follows_everything_that_enters_the_build(tmp_path, monkeypatch) -> None:
    """One name per set of inputs torch's build.ninja is written from: the same name when nothing
    changes (a symlinked view of the sources included: torch gets their real paths, so its files are
    the same); another one for other sources, flags, environments (sys.prefix, torch's folders) or
    compilers, so two of them never rebuild one build in place in turn."""
    import shutil

    import torch.utils.cpp_extension as cpp

    name = build.build_name("scalar")
    assert build.build_name("scalar") == name
    link = tmp_path / "link"
    link.symlink_to(build.CSRC, target_is_directory=True)
    assert build.build_name("scalar", csrc=str(link)) == name and build.sources(str(link)) == build.SOURCES
    copy = tmp_path / "checkout2"
    shutil.copytree(build.CSRC, copy)
    others = {"another checkout": build.build_name("scalar", csrc=str(copy)),
              "other flags": build.build_name("scalar", build.FAST_MATH_FLAGS)}
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv2"))
    others["another sys.prefix"] = build.build_name("scalar")
    monkeypatch.undo()
    monkeypatch.setattr(cpp, "_TORCH_PATH", str(tmp_path / "venv2" / "torch"))
    monkeypatch.setattr(cpp, "TORCH_LIB_PATH", str(tmp_path / "venv2" / "torch" / "lib"))
    others["another torch"] = build.build_name("scalar")
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "clang++")
    others["another compiler"] = build.build_name("scalar")
    monkeypatch.undo()
    assert name not in others.values() and len(set(others.values())) == len(others), others
    assert build.build_name("scalar") == name


def test_collecting_the_suite_builds_nothing(tmp_path) -> None:
    """Collection knows the levels from the CPU: with an empty build cache and no working compiler
    it finishes, and nothing was built or tried."""
    extensions = tmp_path / "extensions"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "CXX": "false"}
    done = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", _TESTS],
                          env=env, cwd=os.path.dirname(_TESTS), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert not extensions.exists() or not any(extensions.iterdir()), sorted(extensions.iterdir())


def test_infinities_and_nan_come_out_as_torch_s(kernel_level) -> None:
    """The kernels are built without -ffinite-math-only: masked (-inf) logits, +inf and NaN
    activations give torch's answers (and a bfloat16 NaN stays a NaN)."""
    module = kernel_level.module
    torch.manual_seed(0)
    logits = torch.randn(4, 100) * 3
    logits[0, ::2] = float("-inf")  # half the vocabulary masked
    logits[1, :] = float("-inf")
    logits[1, 37] = 1.5  # one token left: log-probability 0
    logits[2, :97] = float("-inf")  # the tail only, past the vector rows
    ids, logprobs = module.greedy_pick(logits)
    assert ids.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, ids[:, None])[:, 0])
    assert logprobs[1].item() == 0.0
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 2 * 48)
        x[0, 5] = float("inf")  # silu(inf) = inf
        x[1, 7] = float("nan")
        x[2, 48 + 3] = float("nan")  # in up
        x[2, 48 + 40] = float("inf")
        x = x.to(dtype)
        expected = torch.nn.functional.silu(x[:, :48]) * x[:, 48:]
        got = module.silu_and_mul(x)
        torch.testing.assert_close(got, expected, equal_nan=True)
        assert got.isnan().sum() == expected.isnan().sum() == 2
    kernel_level.assert_ran("greedy_pick", "fused_ops")


def test_env_says_where_a_models_layers_run() -> None:
    """``pagedllm env --model M``: the kernel report plus where M's layers run, as the engine logs it
    at start-up (the default model's layers all have loop kernels here)."""
    require_kernels()
    from pagedllm.models.loader import default_model_path

    done = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "env", "--json", "--model",
                           default_model_path()], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["layers"] == "C++ layer loop (30 layers)"
    off = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "env", "--model", default_model_path()],
                         env={**os.environ, "PAGEDLLM_LAYER_STACK": "0"}, capture_output=True, text=True, timeout=300)
    assert off.returncode == 0, off.stderr
    assert "Layers           Python layers: the C++ layer loop switched off" in off.stdout


def test_every_build_runs_the_pinned_ninja(monkeypatch, tmp_path) -> None:
    """A build folder made by one ninja version is rebuilt whole by another (they hash commands
    differently), so the build runs the pinned ninja package's even where PATH finds another first."""
    import shutil

    import ninja

    from pagedllm.kernels.build import _pinned_ninja

    other = tmp_path / "ninja"
    other.write_text("#!/bin/sh\nexit 1\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert shutil.which("ninja") == str(other)
    with _pinned_ninja():
        assert os.path.dirname(shutil.which("ninja")) == ninja.BIN_DIR
    assert shutil.which("ninja") == str(other)
