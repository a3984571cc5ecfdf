"""A missing tool or a failed kernel build fails the run; leaving either out is asked for
(``PAGEDLLM_TEST_WITHOUT``, ``PAGEDLLM_CPU_KERNEL=0``) and the terminal summary says so."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from requirements_here import REQUIREMENTS, Requirement, allowed_missing, require

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_a_missing_tool_fails_unless_the_run_leaves_it_out(monkeypatch) -> None:
    monkeypatch.setitem(REQUIREMENTS, "ghost", Requirement("ghost", lambda: None, "apt-get install ghost"))
    monkeypatch.delenv("PAGEDLLM_TEST_WITHOUT", raising=False)
    with pytest.raises(pytest.fail.Exception, match="ghost is missing .*PAGEDLLM_TEST_WITHOUT=ghost"):
        require("ghost")
    monkeypatch.setenv("PAGEDLLM_TEST_WITHOUT", "ray, ghost")
    with pytest.raises(pytest.skip.Exception, match="left out by PAGEDLLM_TEST_WITHOUT: ghost"):
        require("ghost")
    monkeypatch.setenv("PAGEDLLM_TEST_WITHOUT", "chromum")
    with pytest.raises(pytest.UsageError, match="chromum"):
        allowed_missing()


def test_every_tool_the_suite_needs_is_here() -> None:
    """What scripts/install.sh test installs; a machine it set up lacks none of them."""
    missing = [name for name, requirement in REQUIREMENTS.items() if requirement.find() is None]
    assert not missing or set(missing) <= allowed_missing(), f"missing: {missing}"


# A suite of three tests under the real conftest.py (its hooks and marks), run in a subprocess.
_CONFTEST = f"""
import importlib.util
import sys

sys.path.insert(0, {TESTS!r})
from requirements_here import REQUIREMENTS, Requirement

REQUIREMENTS["ghost"] = Requirement("ghost", lambda: None, "apt-get install ghost")
_spec = importlib.util.spec_from_file_location("suite_conftest", {os.path.join(TESTS, "conftest.py")!r})
_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_suite)
globals().update({{k: v for k, v in vars(_suite).items() if k.startswith("pytest_")}})
"""
_TESTS = """
import pytest
from requirements_here import require


def test_needs_ghost():
    require("ghost")


@pytest.mark.kernels
def test_needs_the_kernels():
    pass


def test_plain():
    pass
"""


def _run_suite(tmp_path, **env: str) -> tuple[int, str]:
    (tmp_path / "conftest.py").write_text(textwrap.dedent(_CONFTEST))
    (tmp_path / "test_three.py").write_text(_TESTS)
    environment = {k: v for k, v in os.environ.items() if k not in ("PAGEDLLM_TEST_WITHOUT", "PAGEDLLM_CPU_KERNEL")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
                          env={**environment, **env}, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def test_a_broken_compiler_fails_the_run_and_a_run_without_kernels_says_so(tmp_path) -> None:
    # No compiler that works, an empty build cache: the kernels' test fails with the build's reason.
    code, out = _run_suite(tmp_path, CXX="false", TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"),
                           PAGEDLLM_TEST_WITHOUT="ghost")
    assert code == 1, out
    assert "1 passed, 1 skipped, 1 error" in out and "CPU kernels did not build" in out, out
    assert "FAILED to build" in out and "left out by PAGEDLLM_TEST_WITHOUT: ghost" in out, out
    # The kernels off on purpose: their test skips and the summary says so; the missing tool fails.
    code, out = _run_suite(tmp_path, PAGEDLLM_CPU_KERNEL="0")
    assert code == 1 and "1 failed, 1 passed, 1 skipped" in out and "ghost is missing" in out, out
    assert "CPU KERNELS WERE OFF (PAGEDLLM_CPU_KERNEL=0): 1 tests that need them skipped" in out, out
