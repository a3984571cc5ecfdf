"""The CPU kernels' sources compile where no test machine runs them: for aarch64 (the scalar level,
the only one off x86) with Debian's cross compiler, and on x86 at the levels this CPU lacks (an
AVX2 host still compiles the AVX-512 and AMX branches). Syntax checks only (``-fsyntax-only``):
nothing is linked or run, so they catch a missing include guard or an intrinsic outside its
``#if``, not a wrong result.

torch's headers dominate the time (ATen/ATen.h is ~6 s of parsing per source), so each set of flags
precompiles ATen/ATen.h once and the sources that include it first take the precompiled header
(~1 s each). The flags are exactly the sources' own, so GCC uses the same declarations it would
parse; where it cannot use the precompiled header it parses ATen/ATen.h itself (slower, as valid).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from kernel_levels import NOT_ON_THIS_CPU
from requirements_here import require

from pagedllm.kernels import build, isa

NATIVE_CXX = shutil.which("g++")
_ATEN = "ATen/ATen.h"
_FIRST_DIRECTIVE = re.compile(r"^\s*#.*$", re.MULTILINE)
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
# The macros the compiler defines for the levels' flags (isa.py), which our #if blocks test.
_ISA_MACRO = re.compile(r"\b__(AVX|AMX|F16C|FMA)\w*__")


def _torch_flags() -> list[str]:
    """What torch's cpp_extension adds to our flags when it builds the kernels (includes, defines)."""
    from torch.utils.cpp_extension import include_paths

    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    return [
        "-std=c++20",
        *(f"-I{path}" for path in includes),
        "-DTORCH_EXTENSION_NAME=pagedllm_kernels_syntax_check",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
    ]


def _includes_aten_first(source: str) -> bool:
    # GCC takes a precompiled header only for a source's first #include, before any other directive.
    with open(source, encoding="utf-8") as f:
        first = _FIRST_DIRECTIVE.search(f.read())
    return first is not None and first.group().split() == ["#include", f"<{_ATEN}>"]


def _has_isa_code(path: str) -> bool:
    """Whether a source, or a header of ours it includes, has code under an instruction-set #if."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return _ISA_MACRO.search(text) is not None or any(
        _has_isa_code(os.path.join(os.path.dirname(path), name)) for name in _LOCAL_INCLUDE.findall(text)
    )


def _run(cmd: list[str]) -> str | None:
    """None where the compiler accepts it, else its diagnostics (the end, where a long one is cut)."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return None if done.returncode == 0 else (done.stdout + done.stderr)[-4000:]


def _precompile_aten(cxx: str, flags: list[str], folder: str) -> str | None:
    """ATen/ATen.h precompiled for ``flags`` into ``folder``/ATen (None), or why torch's header alone
    fails to compile with them."""
    from torch.utils.cpp_extension import include_paths

    os.makedirs(os.path.join(folder, "ATen"))
    header = os.path.join(include_paths()[0], _ATEN)
    # GCC looks for ATen.h.gch in each include folder before ATen.h, so -I folder first picks it up.
    # Its "#pragma once" does not carry into the precompiled header (a header compiled alone is its
    # own main file), so the next `#include <ATen/ATen.h>` (kernels.h's, quant_formats.h's) resolves
    # to this folder: the link makes it the real header again, whose own includes are all done.
    os.symlink(header, os.path.join(folder, _ATEN))
    return _run([cxx, "-x", "c++-header", *flags, header, "-o", os.path.join(folder, _ATEN + ".gch")])


def _check_sources(cxx: str, level_flags: dict[str, list[str]], sources: list[str]) -> tuple[dict[str, str], list[str]]:
    """Syntax-checks the kernel sources with each level's flags, two compiles at a time (the machines
    that run the suite have two cores). Returns why ATen/ATen.h alone failed, per level, and the
    failures of our sources."""
    torch_flags = _torch_flags()
    aten_first = [src for src in sources if _includes_aten_first(src)]
    others = [src for src in sources if src not in aten_first]  # bindings.cpp: torch/extension.h
    header_errors: dict[str, str] = {}
    checks: list[tuple[str, str, Future[str | None]]] = []
    with tempfile.TemporaryDirectory(prefix="pagedllm-syntax-") as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        # A precompiled header is ~400 MB; pytest's tmp_path keeps three runs' worth, so a tempdir.
        headers = {}
        for level, flags in level_flags.items():
            full = [*flags, *torch_flags]
            headers[level] = pool.submit(_precompile_aten, cxx, full, os.path.join(tmp, level))
            # Started beside the precompile: bindings.cpp alone (~23 s) takes about as long.
            checks += [(level, src, pool.submit(_run, [cxx, "-fsyntax-only", *full, src])) for src in others]
        for level, flags in level_flags.items():
            error = headers[level].result()
            if error is not None:
                header_errors[level] = error
                continue
            full = ["-Winvalid-pch", f"-I{os.path.join(tmp, level)}", *flags, *torch_flags]
            checks += [(level, src, pool.submit(_run, [cxx, "-fsyntax-only", *full, src])) for src in aten_first]
        failures = [
            f"{level}: {os.path.relpath(src)}\n{error}"
            for level, src, check in checks
            if (error := check.result()) is not None
        ]
    return header_errors, failures


def _first_error(diagnostics: str) -> str:
    return next((line for line in diagnostics.splitlines() if "error" in line), diagnostics.strip()[:500])


def test_isa_offers_only_scalar_off_x86(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert not isa.is_x86()
    assert isa.compile_flags("scalar") == []  # the compiler's default target
    with pytest.raises(ValueError, match="x86 only"):
        isa.compile_flags("avx2")
    assert isa.best_level() == "scalar" and isa.runnable_levels() == ("scalar",)
    assert isa.resolve_level("auto") == "scalar"
    assert isa.missing_features("amx") == ["x86 (aarch64 CPU)"]
    env = {"PAGEDLLM_CPU_ISA": "scalar"}
    monkeypatch.delitem(sys.modules, "torch")  # as before torch's import, where the caps would apply on x86
    isa.cap_torch_to_forced_level(env)
    assert env == {"PAGEDLLM_CPU_ISA": "scalar"}  # torch's x86 capability names mean nothing there


def test_kernels_compile_for_aarch64(monkeypatch: pytest.MonkeyPatch) -> None:
    cross_cxx = require("aarch64-cross")
    # The flags an aarch64 machine builds with: build.cflags reads the machine through isa.
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    flags = build.cflags("scalar")
    monkeypatch.undo()
    assert "-DPAGEDLLM_ISA=scalar" in flags and not any(flag.startswith("-m") for flag in flags)
    header_errors, failures = _check_sources(cross_cxx, {"scalar": flags}, build.SOURCES)
    if header_errors:
        # The installed headers are an x86 torch's: if one of them does not parse for aarch64, this
        # check cannot judge our sources (an aarch64 torch ships its own).
        pytest.skip(
            f"torch's own {_ATEN} (this x86 install's) does not compile for aarch64, so our sources "
            f"cannot be checked against it: {_first_error(header_errors['scalar'])}"
        )
    assert not failures, "the scalar kernels do not compile for aarch64:\n\n" + "\n\n".join(failures)


@pytest.mark.skipif(NATIVE_CXX is None or not isa.is_x86(), reason="needs g++ on an x86 machine")
def test_levels_this_cpu_lacks_still_compile() -> None:
    # The levels this CPU runs are built for real by the kernel tests (scripts/install.sh --all);
    # the ones above its best are only ever compiled on other machines, so check them here.
    above = isa.LEVELS[isa.level_index(isa.best_level()) + 1 :]
    if not above:
        pytest.skip(f"{NOT_ON_THIS_CPU}: it runs every level, and the kernel tests build each")
    # A source with no instruction-set code compiles to the same declarations at every level (torch's
    # header at the level's flags is compiled on its own), and the runnable levels' builds check it:
    # bindings.cpp, the slowest (torch/extension.h, ~23 s), is one.
    sources = [src for src in build.SOURCES if _has_isa_code(src)]
    header_errors, failures = _check_sources(NATIVE_CXX, {level: build.cflags(level) for level in above}, sources)
    failures += [f"{level}: torch's {_ATEN} alone\n{error}" for level, error in header_errors.items()]
    assert not failures, "kernel sources fail to compile at levels this CPU lacks:\n\n" + "\n\n".join(failures)
