"""A step of a Llama-style decoder through one C++ call over all its layers (``run_layer_stack``
in kernels/csrc/layer_stack_cpu.cpp) instead of the per-layer Python.

A decode step's kernels are short (a few rows), so the Python around them weighs: on the
default model (30 layers) ~25 Python-level operations per layer cost 4-5 ms of a 37 ms bfloat16
step, and as much of a short prompt's step. The C++ loop calls the same kernels with the same
arguments in the same order, so its outputs equal the Python layers' bit for bit. Attention follows
the step's plan (``PagedAttention.cpu_plan``); steps whose plan gives a sequence to torch's SDPA
(float32 prompts), or splits the batch into scattered rows, stay on the Python layers, as does
everything else the loop does not reproduce (GPUs, weights multiplied by torch or oneDNN, tensor
parallelism, other norms, q/k norms, MoE, soft caps, attention sinks, parallel residuals, norms after each block,
residual multipliers, layers without rope, rope depending on sequence length, per-layer windows in a
step with prompts). Weights may be our float panels or quantized rows (int8 tiles, packed blocks,
float segments, mixed within a layer as GGUF files mix them).
``PAGEDLLM_LAYER_STACK=0`` turns it off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.attention import AttentionMetadata
from pagedllm.attention.kv_quant import cache_format
from pagedllm.kernels import cpu_kernels, kernel_config
from pagedllm.kernels.codes import (
    ACTIVATION_CODES,
    DECODE_KERNEL,
    FLOAT_ROWS,
    GATED_PANEL,
    INT8_TILED,
    PANEL,
    QUANT_BLOCKS,
)
from pagedllm.kernels.invariance import batch_invariant, int8_amx_min_rows
from pagedllm.models.cpu_gemm import GatedPanelWeight, PanelWeight
from pagedllm.models.fused_ops import ACT_AND_MUL_KERNELS
from pagedllm.models.layers import RMSNorm
from pagedllm.quantization.int8_tiles import Int8TiledTensor
from pagedllm.quantization.kernels import cpu_kernels_serve, small_m
from pagedllm.quantization.packed import PackedTensor, QuantizedWeight

if TYPE_CHECKING:
    from pagedllm.models.decoder import DecoderModel

_EMPTY = torch.empty(0)
# A step's attention plan for run_layer_stack: per part its kernel, its rows' [begin, end) flattened,
# and its block_tables, query_start_loc and context_lens flattened.
Plan = tuple[list[int], list[int], list[torch.Tensor]]
# A segment as the loop takes it: kind, format id, rows, weight data, bias (empty: none).
Segment = tuple[int, int, int, torch.Tensor, torch.Tensor]


class LayerStack:
    """The layers' weights gathered once for ``run_layer_stack``; ``run`` adds the step's caches and plan."""

    def __init__(self, model: DecoderModel, module, layer_linears: list[list[list[Segment]]]) -> None:
        self._module = module
        first = model.layers[0]
        attn = first.self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = attn.attn.scale
        self.eps = first.input_layernorm.eps
        self.intermediate_size = first.mlp.down_proj.in_features
        self.windows = [layer.self_attn.attn.sliding_window or 0 for layer in model.layers]
        self.activation = ACTIVATION_CODES[ACT_AND_MUL_KERNELS[first.mlp.act_and_mul.activation]]
        # The first layer's attention plans every layer's step: the plan depends only on the window.
        self.planner = attn.attn if len(set(self.windows)) == 1 else None
        self.layer_tensors: list[list[torch.Tensor]] = []
        # Read at every step: calibration sets the key offsets after the stack is built.
        self.attentions = [layer.self_attn.attn for layer in model.layers]
        self.linear_specs: list[int] = []
        self.linear_tensors: list[torch.Tensor] = []
        for layer, linears in zip(model.layers, layer_linears, strict=True):
            self.layer_tensors.append([layer.input_layernorm.weight, layer.post_attention_layernorm.weight])
            for segments in linears:
                self.linear_specs.append(len(segments))
                for kind, fmt, rows, weight, bias in segments:
                    self.linear_specs += (kind, fmt, rows)
                    self.linear_tensors += (weight, bias)

    def plan(self, meta: AttentionMetadata, hidden: torch.Tensor, k_cache: torch.Tensor) -> Plan | None:
        """The step's attention plan as ``run_layer_stack`` takes it: (kernels, row ranges, tensors),
        or None when the Python layers must run the step."""
        if k_cache.dtype != hidden.dtype and cache_format(k_cache) is None:
            return None
        if meta.is_all_decode:
            parts = [(DECODE_KERNEL, meta)]
        elif batch_invariant():  # as the Python layers attend: every row as a decode at its position
            parts = [(DECODE_KERNEL, meta.per_row)]
        elif self.planner is None:
            return None
        else:
            # A stand-in for the step's queries: their dtype, device and head size.
            query = hidden.new_empty((0, self.head_dim))
            parts, sdpa = self.planner.cpu_plan(meta, query, k_cache)
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
        for norms, attn, (k_cache, v_cache) in zip(self.layer_tensors, self.attentions, kv_caches, strict=True):
            tensors += norms
            tensors += (k_cache, v_cache, _EMPTY if attn.key_offset is None else attn.key_offset)
        cos, sin = rope
        kernels, rows, part_tensors = plan
        return self._module.run_layer_stack(
            hidden, tensors, self.linear_specs, self.linear_tensors, self.windows, cos.squeeze(1), sin.squeeze(1),
            meta.slot_mapping, kernels, rows, part_tensors, self.num_heads, self.num_kv_heads, self.head_dim,
            self.intermediate_size, self.activation, small_m(), int8_amx_min_rows(), self.eps, self.scale,
        )


def _bias(bias: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY if bias is None else bias.detach()


def build_layer_stack(model: DecoderModel) -> LayerStack | None:
    """A LayerStack when the C++ loop reproduces these layers exactly, else None."""
    if not kernel_config().layer_stack or not model.layers:
        return None
    if len(model.rotary) != 1 or model.rope_needs_lengths:
        return None
    module = cpu_kernels()
    if module is None or not hasattr(module, "run_layer_stack"):
        return None
    # One set of shapes and norms for every layer: the loop takes them once.
    if not all(_layer_qualifies(layer) for layer in model.layers) or len(set(map(_settings, model.layers))) != 1:
        return None
    layer_linears = [_layer_linears(layer) for layer in model.layers]
    if any(None in linears for linears in layer_linears):
        return None
    return LayerStack(model, module, layer_linears)


def weights_key(model: DecoderModel) -> int | None:
    """Names the weights a LayerStack was built over: a new key after repacking or retiling."""
    if not model.layers:
        return None
    qkv = model.layers[0].self_attn.qkv_proj
    if qkv.packed_weight is not None or not isinstance(qkv.weight, QuantizedWeight):
        return id(qkv.packed_weight)
    return id(qkv.weight.segments[0].weight)


def _settings(layer) -> tuple:
    a = layer.self_attn
    return (a.num_heads, a.num_kv_heads, a.head_dim, a.attn.scale, layer.input_layernorm.eps,
            layer.post_attention_layernorm.eps, layer.mlp.down_proj.in_features, layer.mlp.act_and_mul.activation,
            layer.input_layernorm.weight.dtype)


def _layer_qualifies(layer) -> bool:
    from pagedllm.models.decoder import DecoderAttention, GatedMLP

    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not DecoderAttention or type(mlp) is not GatedMLP:
        return False
    if layer.parallel_residual or layer.sandwich or attn.q_norm is not None:
        return False
    # The loop norms each block's input, adds its output unscaled, and rotates q and k in every layer.
    if layer.post_norms or layer.residual_scale is not None or not attn.use_rope:
        return False
    if type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm:
        return False
    if layer.input_layernorm.weight.dtype not in (torch.float32, torch.bfloat16):
        return False  # the norm and activation kernels' dtypes
    if mlp.act_and_mul.activation not in ACT_AND_MUL_KERNELS:
        return False
    paged = attn.attn
    # Sinks: the loop's attention kernels do not take them yet (the Python layer attends through torch).
    if not paged.cpu_kernels_apply or paged.logits_soft_cap is not None or paged.sinks is not None:
        return False
    return all(p.tp_size == 1 for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))


def _layer_linears(layer) -> list[list[Segment] | None]:
    """The layer's qkv, o, gate/up and down weights as the loop multiplies them (None: it cannot)."""
    a, mlp = layer.self_attn, layer.mlp
    return [_segments(a.qkv_proj), _segments(a.o_proj), _segments(mlp.gate_up_proj, gated=True),
            _segments(mlp.down_proj)]


def _segments(linear, gated: bool = False) -> list[Segment] | None:
    """The row segments of a linear layer's weight, each with its kernel, as the Python layer
    multiplies them (``cpu_gemm.dense``, ``QuantizedWeight.linear``), or None."""
    packed = linear.packed_weight
    if type(packed) is GatedPanelWeight:
        # Only a gated MLP's gate/up layer uses the fused epilogue, with the bias reordered to match.
        return [(GATED_PANEL, 0, packed.out_features, packed.data, _bias(packed.bias))] if gated else None
    if type(packed) is PanelWeight:
        return [(PANEL, 0, packed.out_features, packed.data, _bias(linear.bias))]
    weight = linear.weight
    if packed is not None or not isinstance(weight, QuantizedWeight):
        return None  # oneDNN or torch multiply it
    whole = len(weight.segments) == 1
    segments = []
    for seg in weight.segments:
        bias = linear.bias if whole or linear.bias is None else linear.bias[seg.offset:seg.offset + seg.rows]
        rows = seg.weight
        if isinstance(rows, Int8TiledTensor):
            segments.append((INT8_TILED, rows.fmt.id, seg.rows, rows.data, _bias(bias)))
        elif isinstance(rows, PackedTensor):
            # Act-order rows (GPTQ desc_act) take their input permuted: the Python layer does that.
            if rows.input_order is not None or not cpu_kernels_serve(rows.data.device, rows.in_features, rows.fmt):
                return None
            segments.append((QUANT_BLOCKS, rows.fmt.id, seg.rows, rows.data, _bias(bias)))
        else:
            segments.append((FLOAT_ROWS, 0, seg.rows, rows, _bias(bias)))
    return segments
