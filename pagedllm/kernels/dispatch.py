"""Which build of the CPU kernels runs: the one of the level ``kernel_config().isa`` names, or of the
best level this CPU has (``auto``). Every caller of the C++ kernels gets its module here.

Builds are loaded once per level and kept: a test may run one level, then another, in one
process (``use_kernel_config(isa=...)``); a model keeps the module it was built with.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from types import ModuleType

from pagedllm.kernels.build import build_level
from pagedllm.kernels.codes import check_codes
from pagedllm.kernels.config import KernelConfig, kernel_config
from pagedllm.kernels.isa import level_index, resolve_level

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}
_build_errors: dict[str, str] = {}


def active_isa() -> str:
    """The level the kernels run at: the forced one (checked against this CPU, a ValueError naming
    what it lacks) or the best one here."""
    return resolve_level(kernel_config().isa)


def isa_at_least(level: str) -> bool:
    """Whether the active level includes ``level``'s instructions (False with the kernels off)."""
    return kernel_config().cpu_kernels and level_index(active_isa()) >= level_index(level)


def module_for(level: str, verbose: bool = False) -> ModuleType | None:
    """The module built for ``level`` (built on first use), or None when it cannot be built here."""
    module = _modules.get(level)
    if module is not None or level in _build_errors:
        return module
    with _lock:
        if level in _modules or level in _build_errors:
            return _modules.get(level)
        try:
            module = build_level(level, verbose=verbose)
            check_codes(module)
        except Exception as exc:  # a user's machine without a compiler still serves (the test suite fails)
            _build_errors[level] = f"{type(exc).__name__}: {exc}".strip()
            logger.warning("CPU kernels (%s) did not build (%s); running on the slower torch-native paths "
                           "(PAGEDLLM_CPU_KERNEL=0 chooses them without trying).", level, exc)
            return None
        _modules[level] = module
        return module


# The module cpu_kernels() last answered, and the settings it answered for: every kernel call asks,
# and resolving the level anew (the CPU's features against each level's) cost ~7 us a call.
_answered: tuple[KernelConfig, ModuleType | None] | None = None


def cpu_kernels() -> ModuleType | None:
    """The kernels' module for the active level, or None: turned off (``cpu_kernels=False``), or
    not buildable here (``unavailable_reason`` says why)."""
    global _answered
    config = kernel_config()
    answered = _answered
    if answered is not None and answered[0] is config:
        return answered[1]
    module = module_for(resolve_level(config.isa)) if config.cpu_kernels else None
    _answered = (config, module)
    return module


def unavailable_reason() -> str | None:
    """Why ``cpu_kernels()`` is None (None: it is not)."""
    config = kernel_config()
    if not config.cpu_kernels:
        return "turned off (PAGEDLLM_CPU_KERNEL=0)"
    level = active_isa()
    if module_for(level) is not None:
        return None
    return f"the {level} build failed: {build_error(level)}"


def build_error(level: str) -> str | None:
    """Why the build of ``level`` failed (None: it did not, or was not tried)."""
    return _build_errors.get(level)


def loaded_levels() -> tuple[str, ...]:
    return tuple(_modules)


@contextlib.contextmanager
def module_override(level: str, module: ModuleType) -> Iterator[None]:
    """Inside: ``module`` answers for ``level``, e.g. a build of it with other compiler flags that a
    benchmark runs side by side with the usual one; models built inside keep it."""
    global _answered
    with _lock:
        before = _modules.get(level)
        _modules[level] = module
        _answered = None
    try:
        yield
    finally:
        with _lock:
            if before is None:
                _modules.pop(level, None)
            else:
                _modules[level] = before
            _answered = None
