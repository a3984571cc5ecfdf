"""DeepSeek-V3's feed-forward blocks: the gated MLP, and the mixture of experts with grouped routing.

Routing (``noaux_tc``, as transformers' DeepseekV3TopkRouter): a float32 router gives each expert
a sigmoid score; ``e_score_correction_bias`` is added for choosing only. The experts fall into
``n_group`` groups, a group ranked by the sum of its two best biased scores; the best
``topk_group`` groups stay eligible and the ``num_experts_per_tok`` best biased scores among their
experts are chosen. Each chosen expert weighs its output by its unbiased score, renormalised over
the chosen ones with ``norm_topk_prob``, times ``routed_scaling_factor``. The ``n_shared_experts``
shared experts are one gated MLP that many times as wide, which every token goes through.

Each expert has its own linear layers, so a step runs one GEMM per expert over the tokens routed
to it. Tensor parallelism is refused by the model, so no partial sums are reduced here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.layers.cpu_gemm import GatedPanelWeight, row_invariant_linear
from pagedllm.layers.norms_and_activations import ActAndMul
from pagedllm.layers.parallel_layers import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.models.moe import run_routed_experts


class DeepseekMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one GEMM (the checkpoint's gate_proj / up_proj)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        sizes = {"gate": intermediate_size, "up": intermediate_size}
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, sizes, bias=False)
        self.gate_up_proj.gated_activation = activation  # lets the CPU GEMM fuse act(gate) * up
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)
        self.act_and_mul = ActAndMul(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.gate_up_proj.packed_weight
        if isinstance(packed, GatedPanelWeight):
            return self.down_proj(packed.silu_and_mul(x))
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class GroupedTopkRouter(nn.Module):
    """Sigmoid scores, group-limited top-k choice on bias-corrected scores (float32 throughout, as
    transformers keeps the router and its bias in float32 whatever the model's dtype)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.num_groups = config.n_group or 1
        self.topk_group = config.topk_group or self.num_groups
        self.normalize = bool(config.norm_topk_prob)
        self.scaling = float(config.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(self.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, hidden] -> (weights [T, k] float32, chosen experts [T, k])."""
        # The sigmoid in float64, rounded to float32: torch takes a tensor's last elements (past its
        # whole vectors) through scalar exp, whose last bit differs from the vector one, so in float32
        # a row's scores would follow how many rows share the step; float64's differences vanish in
        # the rounding.
        scores = row_invariant_linear(x.float(), self).double().sigmoid().float()
        biased = scores + self.e_score_correction_bias
        per_group = biased.view(-1, self.num_groups, self.num_experts // self.num_groups)
        group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(per_group).reshape(-1, self.num_experts)
        chosen = torch.topk(biased.masked_fill(~expert_mask, float("-inf")), k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen


class DeepseekMoE(nn.Module):
    """Routed experts plus the shared experts."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate = GroupedTopkRouter(config)
        self.experts = nn.ModuleList(
            DeepseekMLP(config.hidden_size, config.moe_intermediate_size, config.hidden_act)
            for _ in range(config.n_routed_experts)
        )
        self.shared_experts: DeepseekMLP | None = None
        if config.n_shared_experts:
            width = config.moe_intermediate_size * config.n_shared_experts
            self.shared_experts = DeepseekMLP(config.hidden_size, width, config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x)
        out = run_routed_experts(x, weights, chosen, self.experts, lambda expert, rows: expert(rows))
        if self.shared_experts is not None:
            out += self.shared_experts(x)
        return out
