"""The CPU kernels' settings: one typed value per process, read from the environment in one place.

Every choice about which CPU kernel runs reads ``kernel_config()``; nothing else reads these
variables. The environment names them for a process (a server, a benchmark, a test subprocess);
``use_kernel_config`` changes them for a block of code (tests, comparisons), and
``set_kernel_config`` for the rest of the process.

======================================  ===========================================================
variable                                field
======================================  ===========================================================
``PAGEDLLM_CPU_ISA``                    ``isa``: ``auto`` (best level of this CPU) or a level of
                                        kernels/isa.py at or below it
``PAGEDLLM_CPU_KERNEL=0``               ``cpu_kernels=False``: the torch-native paths everywhere
``PAGEDLLM_CPU_GEMM``                   ``gemm``: ``auto`` | ``panels`` | ``onednn`` | ``torch``
``PAGEDLLM_QUANT_KERNEL=torch``         ``quant_kernel="torch"``: packed weights through the torch
                                        reference
``PAGEDLLM_LAYER_STACK=0``              ``layer_stack=False``: the Python layers only
``PAGEDLLM_INT8_AMX_MIN_ROWS``          ``int8_amx_min_rows``: rows from which int8-tiled products
                                        run on AMX (0: never)
``PAGEDLLM_CPU_BF16=0``                 ``cpu_bf16=False``: ``dtype="auto"`` keeps float32
``PAGEDLLM_HUGE_PAGES=0``               ``huge_pages=False``: weights and KV pool in torch's pages
``PAGEDLLM_BATCH_INVARIANT=0``          ``batch_invariant=False``: kernels chosen by the step's
                                        row counts (faster long prompts; a sequence's logits then
                                        depend on the rest of its batch, see kernels/invariance.py)
======================================  ===========================================================

This module never imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from pagedllm.kernels.isa import LEVELS

GEMM_CHOICES = ("auto", "panels", "onednn", "torch")
QUANT_KERNEL_CHOICES = ("cpp", "torch")


@dataclass(frozen=True, slots=True)
class KernelConfig:
    isa: str = "auto"
    cpu_kernels: bool = True
    gemm: str = "auto"
    quant_kernel: str = "cpp"
    layer_stack: bool = True
    int8_amx_min_rows: int = 32
    cpu_bf16: bool = True
    huge_pages: bool = True
    batch_invariant: bool = True

    def __post_init__(self) -> None:
        if self.isa != "auto" and self.isa not in LEVELS:
            raise ValueError(f"PAGEDLLM_CPU_ISA={self.isa!r}: expected auto or one of {', '.join(LEVELS)}")
        if self.gemm not in GEMM_CHOICES:
            raise ValueError(f"PAGEDLLM_CPU_GEMM={self.gemm!r}: expected one of {', '.join(GEMM_CHOICES)}")
        if self.quant_kernel not in QUANT_KERNEL_CHOICES:
            raise ValueError(
                f"PAGEDLLM_QUANT_KERNEL={self.quant_kernel!r}: expected one of {', '.join(QUANT_KERNEL_CHOICES)}"
            )
        if not isinstance(self.int8_amx_min_rows, int) or self.int8_amx_min_rows < 0:
            raise ValueError(
                f"PAGEDLLM_INT8_AMX_MIN_ROWS must be a number of rows (0: never), got {self.int8_amx_min_rows!r}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KernelConfig:
        env = os.environ if env is None else env
        rows = env.get("PAGEDLLM_INT8_AMX_MIN_ROWS", "32").strip()
        if not rows.isdigit():
            raise ValueError(f"PAGEDLLM_INT8_AMX_MIN_ROWS must be a number of rows (0: never), got {rows!r}")
        return cls(
            isa=env.get("PAGEDLLM_CPU_ISA", "auto").strip().lower() or "auto",
            cpu_kernels=env.get("PAGEDLLM_CPU_KERNEL", "1") != "0",
            gemm=env.get("PAGEDLLM_CPU_GEMM", "auto"),
            quant_kernel=env.get("PAGEDLLM_QUANT_KERNEL", "cpp"),
            layer_stack=env.get("PAGEDLLM_LAYER_STACK", "1") != "0",
            int8_amx_min_rows=int(rows),
            cpu_bf16=env.get("PAGEDLLM_CPU_BF16", "1") != "0",
            huge_pages=env.get("PAGEDLLM_HUGE_PAGES", "1") != "0",
            batch_invariant=env.get("PAGEDLLM_BATCH_INVARIANT", "1") != "0",
        )

    def to_env(self) -> dict[str, str]:
        """The environment that gives a child process this configuration."""
        return {
            "PAGEDLLM_CPU_ISA": self.isa,
            "PAGEDLLM_CPU_KERNEL": "1" if self.cpu_kernels else "0",
            "PAGEDLLM_CPU_GEMM": self.gemm,
            "PAGEDLLM_QUANT_KERNEL": self.quant_kernel,
            "PAGEDLLM_LAYER_STACK": "1" if self.layer_stack else "0",
            "PAGEDLLM_INT8_AMX_MIN_ROWS": str(self.int8_amx_min_rows),
            "PAGEDLLM_CPU_BF16": "1" if self.cpu_bf16 else "0",
            "PAGEDLLM_HUGE_PAGES": "1" if self.huge_pages else "0",
            "PAGEDLLM_BATCH_INVARIANT": "1" if self.batch_invariant else "0",
        }


_lock = threading.Lock()
_current: KernelConfig | None = None


def kernel_config() -> KernelConfig:
    """This process's kernel settings (from the environment on first use)."""
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                _current = KernelConfig.from_env()
    return _current


def set_kernel_config(config: KernelConfig) -> None:
    global _current
    with _lock:
        _current = config


@contextlib.contextmanager
def use_kernel_config(**changes) -> Iterator[KernelConfig]:
    """The current settings with ``changes`` inside the block, the previous ones after it. Models
    built inside keep the kernels they were built with."""
    before = kernel_config()
    config = dataclasses.replace(before, **changes)
    set_kernel_config(config)
    try:
        yield config
    finally:
        set_kernel_config(before)
