"""The gated MLP (a dense layer's, and each expert's) and the sparse mixture of experts.

``SparseMoE`` routes each token to its top-k experts (Mixtral, Qwen3-MoE, Qwen2-MoE); Qwen2-MoE
adds a shared expert that every token goes through, its output scaled per token by
``sigmoid(shared_expert_gate(x))``. Each expert is a ``GatedMLP`` with its own linear layers, so a
GGUF file's experts stay packed as any linear's weights do: one 2-D packed weight per expert,
cut out of llama.cpp's stacked 3-D tensors by the GGUF loader.

GPT-OSS configures the same module differently: its router has a bias and takes the top k logits
before a softmax over those k; its experts have biases and a clamped SwiGLU (``ClampedSwiGLU``).
Its checkpoints store each layer's experts fused in 3-D tensors, transposed against nn.Linear and
with gate and up interleaved; ``split_fused_experts`` cuts them into the per-expert linears at load
(float tensors, or MXFP4 blocks kept packed: quantization/mxfp4.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from pagedllm.layers.cpu_gemm import GatedPanelWeight, dense, row_invariant_linear
from pagedllm.layers.norms_and_activations import ActAndMul
from pagedllm.layers.parallel_layers import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.layers.parallel_state import all_reduce
from pagedllm.models.families import DecoderSettings
from pagedllm.quantization.packed import PackedTensor


class ClampedSwiGLU(nn.Module):
    """GPT-OSS's expert activation over [T, 2I] (gate, then up): the gate clamped from above, the up
    projection on both sides, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    activation = "clamped_swiglu"  # its code in the C++ layer loop, which computes it as forward does

    def __init__(self, limit: float, alpha: float) -> None:
        super().__init__()
        self.limit = limit
        self.alpha = alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.split(x.shape[-1] // 2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one GEMM; ``clamped`` (an expert of GPT-OSS):
    ClampedSwiGLU in place of act(gate) * up."""

    def __init__(self, s: DecoderSettings, intermediate_size: int, bias: bool, clamped: bool = False) -> None:
        super().__init__()
        sizes = {"gate": intermediate_size, "up": intermediate_size}
        self.gate_up_proj = MergedColumnParallelLinear(s.hidden_size, sizes, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, s.hidden_size, bias=bias)
        self.act_and_mul: nn.Module
        if clamped and s.swiglu_limit is not None:
            # Not gated_activation: the CPU GEMM's fused epilogue computes the plain silu(gate) * up.
            self.act_and_mul = ClampedSwiGLU(s.swiglu_limit, s.swiglu_alpha)
        else:
            self.gate_up_proj.gated_activation = s.activation  # lets the CPU GEMM fuse act(gate) * up
            self.act_and_mul = ActAndMul(s.activation)

    def activated(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate(x)) * up(x): one kernel when the gate/up weight is packed for it."""
        packed = self.gate_up_proj.packed_weight
        if isinstance(packed, GatedPanelWeight):
            return packed.silu_and_mul(x)
        return self.act_and_mul(self.gate_up_proj(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all-reduce (experts reduce once, together);
        a down bias is added by rank 0 only, so that the reduction counts it once."""
        bias = self.down_proj.bias if self.down_proj.tp_state.rank == 0 else None
        return dense(self.activated(x), self.down_proj, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activated(x))


def run_routed_experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, experts: Sequence[nn.Module],
                       apply: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Sum over each token's chosen experts (``chosen``, ``weights``: [T, k]) of weight * apply(expert,
    token). Tokens are grouped by expert, so each expert runs one GEMM over all its tokens of the step."""
    top_k = chosen.shape[1]
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)
    tokens = order // top_k
    token_weights = weights.flatten()[order]
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in zip(experts, counts):
        if count:
            rows = tokens[start:start + count]
            y = apply(expert, x[rows]) * token_weights[start:start + count, None]
            out.index_add_(0, rows, y.to(out.dtype))
        start += count
    return out


class SparseMoE(nn.Module):
    """Top-k routed experts, and a gated shared expert where the family has one. Tokens are grouped
    by expert, so each expert runs one GEMM over all its tokens of the step. Under tensor
    parallelism every expert (the shared one too) is split like an MLP, and the summed partial
    outputs are all-reduced once."""

    def __init__(self, s: DecoderSettings) -> None:
        super().__init__()
        self.top_k = s.num_experts_per_token
        self.routing = s.family.routing
        if self.routing not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"unknown expert routing {self.routing!r}")
        # A softmax over the chosen k already sums to one.
        self.normalize = s.normalize_expert_weights and self.routing == "softmax_topk"
        # The router stays a plain float linear on every rank: quantizing it would move routing choices.
        self.gate = nn.Linear(s.hidden_size, s.num_experts, bias=s.family.router_bias)
        self.experts = nn.ModuleList(
            GatedMLP(s, s.expert_intermediate_size, bias=s.family.expert_bias, clamped=True)
            for _ in range(s.num_experts)
        )
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if s.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(s, s.shared_expert_intermediate_size, bias=False)
            # Whole on every rank, like the router: its one scale per token multiplies each rank's
            # partial sum, which the all-reduce then adds up unchanged.
            self.shared_expert_gate = nn.Linear(s.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = row_invariant_linear(x, self.gate).float()
        if self.routing == "topk_softmax":
            top, chosen = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
        else:
            weights, chosen = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        out = run_routed_experts(x, weights, chosen, self.experts, lambda expert, rows: expert.partial(rows))
        if self.shared_expert is not None:
            out += torch.sigmoid(row_invariant_linear(x, self.shared_expert_gate)) * self.shared_expert.partial(x)
        tp_state = self.experts[0].down_proj.tp_state
        return out if tp_state.world_size == 1 else all_reduce(out, tp_state)


# A GPT-OSS layer's fused expert tensors (the bias after its weight in the checkpoint's sorted order).
_FUSED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?")


def _expert_rows(tensor: torch.Tensor | PackedTensor, expert: int, num_experts: int, start: int,
                 step: int) -> torch.Tensor | PackedTensor:
    """Rows start::step of one expert's [rows, ...] weight (or bias) out of all experts' stack."""
    if isinstance(tensor, PackedTensor):  # every expert's rows one after another, whole blocks per row
        data = tensor.data.view(num_experts, -1, tensor.data.shape[1])[expert, start::step]
        return PackedTensor(data, tensor.fmt, tensor.in_features)
    return tensor[expert, start::step]


def split_fused_experts(weights: Iterable[tuple[str, torch.Tensor | PackedTensor]],
                        num_experts: int) -> Iterator[tuple[str, torch.Tensor | PackedTensor]]:
    """GPT-OSS's fused experts as per-expert linears; every other tensor as it comes.

    Float weights are [E, in, out] (``x @ W``): ``gate_up_proj`` [E, hidden, 2I], its output
    columns gate and up interleaved (even: gate, odd: up); ``down_proj`` [E, I, hidden]; biases
    [E, out] in the same column order. An MXFP4 checkpoint's weights arrive already packed in
    nn.Linear's orientation, all experts' rows stacked ([E * out, in], quantization/mxfp4.py).
    Slices are views: the loader copies only the expert's rows it keeps.
    """
    for name, tensor in weights:
        match = _FUSED_EXPERTS.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        prefix, proj, is_bias = match.groups()
        kind = "bias" if is_bias else "weight"
        if not is_bias and isinstance(tensor, torch.Tensor):
            if tensor.dim() != 3 or tensor.shape[0] != num_experts:
                raise ValueError(f"{name}: expected [{num_experts} experts, in, out], got {tuple(tensor.shape)}")
            tensor = tensor.transpose(1, 2)  # -> [E, out, in], nn.Linear's orientation
        for e in range(num_experts):
            if proj == "gate_up_proj":
                yield f"{prefix}.{e}.gate_proj.{kind}", _expert_rows(tensor, e, num_experts, 0, 2)
                yield f"{prefix}.{e}.up_proj.{kind}", _expert_rows(tensor, e, num_experts, 1, 2)
            else:
                yield f"{prefix}.{e}.down_proj.{kind}", _expert_rows(tensor, e, num_experts, 0, 1)
