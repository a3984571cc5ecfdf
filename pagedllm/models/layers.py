"""Building blocks shared by the model files: norms, rotary embedding, weight copying."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

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


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.normalized_shape = (hidden_size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        # Half precision: normalise in float32 as HF does, then scale in the model dtype.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of a config, whether transformers 5 (rope_parameters) or 4 (rope_theta + rope_scaling)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
        out.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    out.setdefault("rope_theta", 10000.0)
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    return out


def compute_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies of rotary embedding; supports default, linear and llama3 scaling."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low_freq_factor = float(params["low_freq_factor"])
        high_freq_factor = float(params["high_freq_factor"])
        old_context_len = float(params["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"rope scaling type {rope_type!r} is not supported (supported: default, linear, llama3)."
    )


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (HF Llama's rotate_half) with a precomputed cos/sin table.

    The table is float32 and kept outside the parameters/buffers so that ``model.to(bfloat16)``
    does not round it; it follows the input's device on first use.
    """

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = compute_inv_freq(head_dim, params)
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)
        self.cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_pos, head_dim]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions, each [T, 1, head_dim // 2]; computed once per step, used by every layer."""
        if self.cos_sin_cache.device != positions.device:
            self.cos_sin_cache = self.cos_sin_cache.to(positions.device)
        cos, sin = self.cos_sin_cache[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, n_heads, head_dim] -> rotated copy (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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
