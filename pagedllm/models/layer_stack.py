"""A step of a Llama-style decoder through one C++ call over all its layers (``run_layer_stack``
in attention/csrc/layer_stack_cpu.cpp) instead of the per-layer Python.

A decode step's kernels are short (a few rows), so the Python around them weighs: on the
default model (30 layers) ~25 Python-level operations per layer cost 4-5 ms of a 37 ms bfloat16
step, and as much of a short prompt's step. The C++ loop calls the same kernels with the same
arguments in the same order, so its outputs equal the Python layers' bit for bit. Attention follows
the step's plan (``PagedAttention.cpu_plan``); steps whose plan gives a sequence to torch's SDPA
(float32 prompts), or splits the batch into scattered rows, stay on the Python layers, as does
everything else the loop does not reproduce (GPUs, quantized or unpacked weights, tensor
parallelism, other norms, q/k norms, MoE, soft caps, parallel residuals, rope depending on sequence
length, per-layer windows in a step with prompts). ``PAGEDLLM_LAYER_STACK=0`` turns it off.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from pagedllm.attention import AttentionMetadata
from pagedllm.attention.backend import DECODE_KERNEL
from pagedllm.attention.cpu_kernels import load_cpu_kernels
from pagedllm.models.cpu_gemm import GatedPanelWeight, PanelWeight
from pagedllm.models.layers import RMSNorm

if TYPE_CHECKING:
    from pagedllm.models.decoder import DecoderModel

_EMPTY = torch.empty(0)
# A step's attention plan for run_layer_stack: per part its kernel, its rows' [begin, end) flattened,
# and its block_tables, query_start_loc and context_lens flattened.
Plan = tuple[list[int], list[int], list[torch.Tensor]]


class LayerStack:
    """The layers' weights gathered once for ``run_layer_stack``; ``run`` adds the step's caches and plan."""

    def __init__(self, model: DecoderModel, module) -> None:
        self._module = module
        first = model.layers[0]
        attn = first.self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = attn.attn.scale
        self.eps = first.input_layernorm.eps
        self.intermediate_size = first.mlp.down_proj.in_features
        self.windows = [layer.self_attn.attn.sliding_window or 0 for layer in model.layers]
        # The first layer's attention plans every layer's step: the plan depends only on the window.
        self.planner = attn.attn if len(set(self.windows)) == 1 else None
        self.weights: list[list[torch.Tensor]] = []
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            gate_up = mlp.gate_up_proj.packed_weight
            self.weights.append([
                layer.input_layernorm.weight, a.qkv_proj.packed_weight.data, _bias(a.qkv_proj.bias),
                a.o_proj.packed_weight.data, _bias(a.o_proj.bias), layer.post_attention_layernorm.weight,
                gate_up.data, _bias(gate_up.bias), mlp.down_proj.packed_weight.data, _bias(mlp.down_proj.bias),
            ])

    def plan(self, meta: AttentionMetadata, hidden: torch.Tensor, k_cache: torch.Tensor) -> Plan | None:
        """The step's attention plan as ``run_layer_stack`` takes it: (kernels, row ranges, tensors),
        or None when the Python layers must run the step."""
        if k_cache.dtype != hidden.dtype:
            return None
        if meta.is_all_decode:
            parts = [(DECODE_KERNEL, meta)]
        elif self.planner is None:
            return None
        else:
            # The cache stands in for the query: the same dtype (checked above), device and head size.
            parts, sdpa = self.planner.cpu_plan(meta, k_cache, k_cache)
            if sdpa:
                return None
        kernels, rows, tensors = [], [], []
        for kernel, part in parts:
            selected = part.decode_rows
            if selected is None:
                rows += (0, meta.query_start_loc[-1])
            elif isinstance(selected, slice):
                rows += (selected.start, selected.stop)
            else:
                return None
            kernels.append(kernel)
            tensors += (part.block_tables, part.query_start_loc_tensor, part.context_lens)
        return kernels, rows, tensors

    def run(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        plan: Plan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after the last layer, as the Python layers leave them."""
        tensors = []
        for weights, (k_cache, v_cache) in zip(self.weights, kv_caches, strict=True):
            tensors += weights
            tensors += (k_cache, v_cache)
        cos, sin = rope
        kernels, rows, part_tensors = plan
        return self._module.run_layer_stack(
            hidden, tensors, self.windows, cos.squeeze(1), sin.squeeze(1), meta.slot_mapping, kernels, rows,
            part_tensors, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size, self.eps,
            self.scale,
        )


def _bias(bias: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY if bias is None else bias.detach()


def build_layer_stack(model: DecoderModel) -> LayerStack | None:
    """A LayerStack when the C++ loop reproduces these layers exactly, else None."""
    if os.environ.get("PAGEDLLM_LAYER_STACK", "1") == "0" or not model.layers:
        return None
    if len(model.rotary) != 1 or model.rope_needs_lengths:
        return None
    module = load_cpu_kernels()
    if module is None or not hasattr(module, "run_layer_stack"):
        return None
    # One set of shapes and norms for every layer: the loop takes them once.
    if not all(_layer_qualifies(layer) for layer in model.layers) or len(set(map(_settings, model.layers))) != 1:
        return None
    return LayerStack(model, module)


def _settings(layer) -> tuple:
    a = layer.self_attn
    return (a.num_heads, a.num_kv_heads, a.head_dim, a.attn.scale, layer.input_layernorm.eps,
            layer.post_attention_layernorm.eps, layer.mlp.down_proj.in_features)


def _layer_qualifies(layer) -> bool:
    from pagedllm.models.decoder import DecoderAttention, GatedMLP

    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not DecoderAttention or type(mlp) is not GatedMLP:
        return False
    if layer.parallel_residual or layer.sandwich or attn.q_norm is not None:
        return False
    if type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm:
        return False
    paged = attn.attn
    if not paged.use_cpu_kernel or paged.logits_soft_cap is not None:
        return False
    if any(p.tp_size != 1 for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
        return False
    return (type(attn.qkv_proj.packed_weight) is PanelWeight and type(attn.o_proj.packed_weight) is PanelWeight
            and type(mlp.gate_up_proj.packed_weight) is GatedPanelWeight
            and type(mlp.down_proj.packed_weight) is PanelWeight)
