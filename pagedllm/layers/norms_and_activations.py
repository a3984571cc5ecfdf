"""Building blocks shared by the model files: activations, norms, weight copying."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers import fused_ops
from pagedllm.quantization.packed import PackedTensor, QuantizedWeight, assign_to


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """HF ``hidden_act`` / ``activation_function`` names -> a torch function."""
    acts: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "silu": F.silu,
        "swish": F.silu,
        "relu": F.relu,
        "gelu": F.gelu,
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    }
    if name not in acts:
        raise ValueError(f"Activation {name!r} is not supported (supported: {', '.join(sorted(acts))}).")
    return acts[name]


class ActAndMul(nn.Module):
    """[T, 2I] (gate, then up) -> act(gate) * up, [T, I]: the gated MLP's middle, one fused kernel on
    CPUs (vLLM's SiluAndMul and its GELU kin)."""

    def __init__(self, activation: str) -> None:
        super().__init__()
        self.activation = activation
        self.act = get_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fused_ops.act_and_mul(x, self.activation)
        if out is not None:
            return out
        gate, up = x.split(x.shape[-1] // 2, dim=-1)
        return self.act(gate) * up


class RMSNorm(nn.Module):
    """``norm(x)``: x normalised. ``norm(x, residual)``: (normalised x + residual, x + residual), the
    residual add fused into the norm as vLLM's layers carry it (on CPUs one kernel, x and residual
    overwritten)."""

    gemma = False  # Gemma's variant scales by 1 + weight

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.normalized_shape = (hidden_size,)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            out = fused_ops.rms_norm(x, self.weight, self.eps, self.gemma)
            return self.reference(x) if out is None else out
        if fused_ops.fused_add_rms_norm(x, residual, self.weight, self.eps, self.gemma):
            return x, residual
        residual = x + residual
        return self.reference(residual), residual

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch code (what transformers computes): GPUs, other dtypes, autograd."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        # Half precision: normalise in float32 as HF does, then scale in the model dtype.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by ``1 + weight`` (weights stored as offsets from one), in float32."""

    gemma = True

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), self.normalized_shape, self.weight.float() + 1.0, self.eps)
        return out.to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm called as RMSNorm is: ``norm(x, residual)`` adds the residual first (unfused)."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return super().forward(x)
        residual = x + residual
        return super().forward(residual), residual


class HeadLayerNorm(nn.Module):
    """LayerNorm without bias over each head of ``[T, heads, head_dim]``, with a weight per head
    (``[heads, head_dim]``): the q/k norms of StableLM and Cohere."""

    def __init__(self, num_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads, head_dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 as both references compute it; the per-head weight cannot go into layer_norm's own.
        out = F.layer_norm(x.float(), x.shape[-1:], eps=self.eps) * self.weight.float()
        return out.to(x.dtype)


def make_norm(kind: str, hidden_size: int, eps: float) -> nn.Module:
    """``rms`` (Llama), ``gemma_rms`` (1 + weight), ``layer`` (LayerNorm with bias) or
    ``layer_nobias`` (Cohere: mean-subtracting, no bias)."""
    if kind == "rms":
        return RMSNorm(hidden_size, eps)
    if kind == "gemma_rms":
        return GemmaRMSNorm(hidden_size, eps)
    if kind == "layer":
        return LayerNorm(hidden_size, eps=eps)
    if kind == "layer_nobias":
        return LayerNorm(hidden_size, eps=eps, bias=False)
    raise ValueError(f"unknown norm kind {kind!r}")


def copy_checked(what: str, target: Any, tensor: Any) -> None:
    """Copy ``tensor`` into ``target`` (a parameter or a slice of one), refusing a shape mismatch.

    Packed weights (pagedllm.quantization) go either way: a packed target stores the tensor as
    packed rows; a packed tensor loaded into a float parameter is dequantized first.
    """
    if assign_to(what, target, tensor):
        return
    if isinstance(tensor, PackedTensor):
        tensor = tensor.dequantize()
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"{what} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}.")
    with torch.no_grad():
        target.copy_(tensor)


class WeightLoader:
    """Copies checkpoint tensors into a model's parameters, shard by shard, and remembers what it loaded."""

    def __init__(self, model: nn.Module, stacked: dict[str, tuple[str, str]] | None = None) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        # Packed weight holders (pagedllm.quantization) take the place of their layers' weight parameters.
        for module_name, module in self.modules.items():
            if isinstance(getattr(module, "weight", None), QuantizedWeight):
                self.params[f"{module_name}.weight"] = module.weight
        # e.g. {"q_proj": ("qkv_proj", "q")}: ".q_proj." in a name goes to shard "q" of ".qkv_proj."
        self.stacked = stacked or {}
        self.loaded: set[str] = set()
        self._shards_seen: dict[str, set[str]] = {}

    def load(self, name: str, tensor: torch.Tensor) -> None:
        for src, (dst, shard) in self.stacked.items():
            marker = f".{src}."
            if marker in name:
                fused = name.replace(marker, f".{dst}.")
                module_name, _, param_kind = fused.rpartition(".")
                module = self.modules.get(module_name)
                if not hasattr(module, "shard_slices") or fused not in self.params:
                    raise ValueError(f"Checkpoint tensor {name!r} has no place in the model.")
                if hasattr(module, "weight_loader"):
                    # A tensor-parallel layer: it cuts this rank's slice of the shard itself.
                    self._load_with(module, name, self.params[fused], tensor, shard)
                else:
                    offset, size = module.shard_slices[shard]
                    self._copy(name, self.params[fused].data[offset:offset + size], tensor)
                seen = self._shards_seen.setdefault(fused, set())
                seen.add(shard)
                if len(seen) == len(module.shard_slices):
                    self.loaded.add(fused)
                return
        if name not in self.params:
            raise ValueError(f"Checkpoint tensor {name!r} has no place in the model.")
        module = self.modules.get(name.rpartition(".")[0])
        if module is not None and hasattr(module, "weight_loader"):
            self._load_with(module, name, self.params[name], tensor, None)
        else:
            self._copy(name, self.params[name].data, tensor)
        self.loaded.add(name)

    @staticmethod
    def _load_with(module: nn.Module, name: str, param: nn.Parameter, tensor: torch.Tensor, shard: str | None) -> None:
        try:
            module.weight_loader(param, tensor, shard)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"Checkpoint tensor {name!r} (shape {tuple(tensor.shape)}) does not fit: {exc}") from exc

    @staticmethod
    def _copy(name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
        copy_checked(f"Checkpoint tensor {name!r}", target, tensor)

    def missing(self) -> list[str]:
        return sorted(set(self.params) - self.loaded)

    def finish(self) -> set[str]:
        """Raise if a parameter got no weights; return the loaded names."""
        missing = self.missing()
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"The checkpoint lacks {len(missing)} weight(s) of the model: {shown}")
        return self.loaded
