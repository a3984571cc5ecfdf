"""Our C++ CPU kernels: built once per instruction-set level (build.py, isa.py), the level chosen
when they are first used (dispatch.py), every setting about them in one typed value (config.py).

``cpu_kernels()`` is the module every caller uses; ``report()`` (``pagedllm env``) says what runs.
"""

from pagedllm.kernels.config import KernelConfig, kernel_config, set_kernel_config, use_kernel_config
from pagedllm.kernels.dispatch import active_isa, cpu_kernels, isa_at_least, unavailable_reason

__all__ = [
    "KernelConfig",
    "active_isa",
    "cpu_kernels",
    "isa_at_least",
    "kernel_config",
    "set_kernel_config",
    "unavailable_reason",
    "use_kernel_config",
]
