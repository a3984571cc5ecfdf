"""What the CPU kernels run here and why: ``pagedllm env`` prints it, the server logs its one line.

As vLLM's collect-env and llama.cpp's system-info line: the CPU and its features, the level in
use and why, per kernel the branch that level compiled (and how often it ran in this process),
torch's and oneDNN's versions, and whether the kernels were built or the torch paths run.
"""

from __future__ import annotations

import platform
import re
from typing import Any

from pagedllm.kernels.config import kernel_config
from pagedllm.kernels.dispatch import active_isa, module_for
from pagedllm.kernels.isa import (
    LEVELS,
    best_level,
    cpu_features,
    cpu_model,
    is_x86,
    missing_features,
    required_features,
)

# The features worth naming in a report (the ones some level needs).
_LEVEL_FEATURES = tuple(dict.fromkeys(f for level in LEVELS for f in required_features(level)))


def _level_and_reason() -> tuple[str | None, str]:
    config = kernel_config()
    best = best_level()
    if config.isa == "auto":
        return best, f"auto: the best level this CPU runs ({best})"
    missing = missing_features(config.isa)
    if missing:
        return None, f"PAGEDLLM_CPU_ISA={config.isa} is refused: this CPU lacks {', '.join(missing)}"
    return config.isa, f"forced by PAGEDLLM_CPU_ISA={config.isa} (this CPU's best: {best})"


def _onednn_version() -> str | None:
    """oneDNN's version as torch's build configuration names it (``Intel(R) MKL-DNN v3.12.0``)."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return None
    found = re.search(r"(?:MKL-DNN|oneDNN)\s+v([0-9][0-9.]*)", torch.__config__.show())
    return found.group(1) if found else "unknown version"


def kernel_report() -> dict[str, Any]:
    """Everything ``pagedllm env --json`` prints."""
    import torch

    config = kernel_config()
    level, why = _level_and_reason()
    features = cpu_features()
    report: dict[str, Any] = {
        "cpu": {
            "model": cpu_model(),
            "machine": platform.machine(),
            "features": [f for f in _LEVEL_FEATURES if f in features],
            "lacks": [f for f in _LEVEL_FEATURES if f not in features] if is_x86() else [],
            "best_level": best_level(),
        },
        "level": level,
        "level_reason": why,
        "settings": {
            "isa": config.isa,
            "cpu_kernels": config.cpu_kernels,
            "gemm": config.gemm,
            "quant_kernel": config.quant_kernel,
            "layer_stack": config.layer_stack,
            "int8_amx_min_rows": config.int8_amx_min_rows,
            "cpu_bf16": config.cpu_bf16,
            "huge_pages": config.huge_pages,
        },
        "torch": torch.__version__,
        "onednn": _onednn_version(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.is_available(),
        "kernels": "unavailable",
        "kernels_reason": None,
        "branches": {},
    }
    if not config.cpu_kernels:
        report["kernels_reason"] = "turned off (PAGEDLLM_CPU_KERNEL=0): the torch paths run"
        return report
    if level is None:
        report["kernels_reason"] = why
        return report
    from pagedllm.kernels.dispatch import build_error

    module = module_for(level)
    if module is None:
        report["kernels_reason"] = f"the {level} build failed, the torch paths run: {build_error(level)}"
        return report
    report["kernels"] = "built"
    report["branches"] = {name: {"branch": branch, "runs": runs} for name, (branch, runs) in
                          sorted(module.kernel_branches().items())}
    return report


def kernel_summary(report: dict[str, Any] | None = None) -> str:
    """The report in one line (the engine's start-up log). A forced level this CPU cannot run
    raises the ValueError that names what it lacks."""
    if kernel_config().cpu_kernels:
        active_isa()
    r = kernel_report() if report is None else report
    head = f"CPU: {r['cpu']['model']}; kernels: "
    if r["kernels"] != "built":
        return head + f"unavailable ({r['kernels_reason']})"
    branches = ", ".join(f"{name} {b['branch']}" for name, b in r["branches"].items() if b["branch"] != "none")
    return head + f"{r['level']} ({r['level_reason']}); {branches}; torch {r['torch']}, oneDNN {r['onednn']}"


def format_report(r: dict[str, Any]) -> str:
    """The report as ``pagedllm env`` prints it."""
    lines = [
        f"CPU              {r['cpu']['model']} ({r['cpu']['machine']})",
        f"  has            {' '.join(r['cpu']['features']) or '-'}",
        f"  lacks          {' '.join(r['cpu']['lacks']) or '-'}",
        f"  best level     {r['cpu']['best_level']}",
        f"Kernel level     {r['level'] or '-'}: {r['level_reason']}",
        f"Kernels          {r['kernels']}" + (f" ({r['kernels_reason']})" if r["kernels_reason"] else ""),
    ]
    for name, b in r["branches"].items():
        lines.append(f"  {name:<24} {b['branch']:<12} {b['runs']} runs")
    settings = ", ".join(f"{k}={v}" for k, v in r["settings"].items())
    lines += [
        f"Settings         {settings}",
        f"torch            {r['torch']} (its own CPU capability: {r['torch_cpu_capability']}; CUDA: {r['cuda']})",
        f"oneDNN           {r['onednn'] or '-'}",
    ]
    return "\n".join(lines)
