"""The decoder's fused elementwise chains (RMSNorm with or without the residual add, act(gate) *
up, rotary embedding) through the C++ CPU kernels of pagedllm/kernels/csrc/fused_ops_cpu.cpp.

Each function returns None (or False) when the kernel cannot serve the call: not a CPU tensor,
a dtype other than float32 / bfloat16, autograd recording, or no compiled kernels. The callers
(layers.py, rotary.py) then run their torch code, which stays the reference and is what runs on
a GPU.
"""

from __future__ import annotations

from types import ModuleType

import torch

from pagedllm.kernels import cpu_kernels

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# The kernel computing act(gate) * up for each activation name.
ACT_AND_MUL_KERNELS = {
    "silu": "silu_and_mul",
    "swish": "silu_and_mul",
    "gelu": "gelu_and_mul",
    "gelu_new": "gelu_tanh_and_mul",
    "gelu_pytorch_tanh": "gelu_tanh_and_mul",
    "gelu_fast": "gelu_tanh_and_mul",
}


def _kernels(*tensors: torch.Tensor) -> ModuleType | None:
    """The compiled module when every tensor is a CPU tensor of one supported dtype that autograd
    does not track; None otherwise."""
    dtype = tensors[0].dtype
    if dtype not in _KERNEL_DTYPES:
        return None
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != dtype or (grad and t.requires_grad):
            return None
    return cpu_kernels()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor | None:
    """RMSNorm over the last dim of a [rows, width] or [rows, heads, width] tensor into a new
    tensor (``gemma``: scaled by 1 + weight), or None."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        return None
    kernels = _kernels(x, weight)
    return None if kernels is None else kernels.rms_norm(x, weight, eps, gemma)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       gemma: bool) -> bool:
    """In place: ``residual += x``, then ``x = rms_norm(residual)``; False when not done."""
    if x.dim() != 2 or x.stride(-1) != 1 or residual.stride(-1) != 1 or x.shape != residual.shape:
        return False
    kernels = _kernels(x, residual, weight)
    if kernels is None:
        return False
    kernels.fused_add_rms_norm(x, residual, weight, eps, gemma)
    return True


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor | None:
    """[T, 2I] (gate, then up) -> act(gate) * up, [T, I]; None for another activation or tensor."""
    name = ACT_AND_MUL_KERNELS.get(activation)
    if name is None or x.dim() != 2 or x.stride(-1) != 1:
        return None
    kernels = _kernels(x)
    return None if kernels is None else getattr(kernels, name)(x)


def rotary_embedding_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate x [T, heads, head_dim] in place by cos, sin [T, 1, rotary_dim // 2] (rotate-half,
    the channels past rotary_dim untouched); False when not done."""
    if x.dim() != 3 or cos.dim() != 3 or cos.shape[1] != 1 or sin.shape != cos.shape:
        return False
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        return False
    kernels = _kernels(x, cos, sin)
    if kernels is None:
        return False
    kernels.rotary_embedding_inplace(x, cos.squeeze(1), sin.squeeze(1))
    return True
