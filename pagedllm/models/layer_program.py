"""Each decoder layer's description (``layer_ops.LayerOps``, which the Python path runs) encoded
for the C++ layer loop: its program.

A program names the layer's wiring (norms before each block, Gemma's sandwich, OLMo 2's norms
after each block, the parallel block), its norms and their tensors, its q/k norms, which rope
table it rotates with, its attention (window, soft cap; the sinks and key offset models/layer_stack.py
reads off the attention at each step), its MLP and activation (or its mixture of experts: their
number, the experts per token, the routing, a shared expert), its residual multiplier and its
linear layers as row segments with their kernels. The C++ layer loop
(kernels/csrc/layer_stack_cpu.cpp) runs programs; ``gaps`` lists the ops of a program the loop
has no kernel for, so whether a model runs there is computed, never kept by hand, and the engine
can say why not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.kernels.codes import (
    ACTIVATION_CODES,
    FLOAT_ROWS,
    GATED_MLP,
    GATED_PANEL,
    GEMMA_RMS,
    INT8_TILED,
    LAYER_NORM,
    MOE,
    NO_QK_NORM,
    PANEL,
    PLAIN_ACTIVATION_CODES,
    PLAIN_MLP,
    QUANT_BLOCKS,
    RMS,
    SOFTMAX_TOPK,
    SOFTMAX_TOPK_NORMALIZED,
    TOPK_SOFTMAX,
)
from pagedllm.layers.cpu_gemm import GatedPanelWeight, PanelWeight, row_invariant_panels
from pagedllm.layers.fused_ops import ACT_AND_MUL_KERNELS
from pagedllm.layers.norms_and_activations import GemmaRMSNorm, HeadLayerNorm, LayerNorm, RMSNorm
from pagedllm.models.decoder_layer import DecoderLayer, PlainMLP
from pagedllm.models.layer_ops import LayerOps
from pagedllm.models.moe import ClampedSwiGLU, GatedMLP, SparseMoE
from pagedllm.quantization.int8_tiles import Int8TiledTensor
from pagedllm.quantization.kernels import cpu_kernels_serve
from pagedllm.quantization.packed import PackedTensor, QuantizedWeight

_EMPTY = torch.empty(0)
# A segment as the loop takes it: kind, format id, rows, weight data, bias (empty: none).
Segment = tuple[int, int, int, torch.Tensor, torch.Tensor]
# The dtypes of the norm, activation and rotary kernels.
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class LayerProgram:
    """``codes``, ``scalars`` and ``norm_tensors`` in run_layer_stack's per-layer order; ``shape``
    the sizes every layer of one call must share; ``gaps`` what has no kernel (empty: it runs)."""

    codes: list[int] = field(default_factory=list)
    scalars: list[float] = field(default_factory=list)
    norm_tensors: list[torch.Tensor] = field(default_factory=list)
    linears: list[list[Segment]] = field(default_factory=list)
    shape: tuple = ()
    gaps: list[str] = field(default_factory=list)


def _bias(bias: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY if bias is None else bias.detach()


def _norm(module, what: str, dtype: torch.dtype, gaps: list[str]) -> tuple[int, list[torch.Tensor], float | None]:
    """(kind, [weight, bias], eps) of a norm module, its gaps added to ``gaps``."""
    if module is None:
        return RMS, [_EMPTY, _EMPTY], None
    if isinstance(module, RMSNorm):  # GemmaRMSNorm too
        if module.weight.dtype not in _KERNEL_DTYPES or module.weight.dtype != dtype:
            gaps.append(f"{what}: a {module.weight.dtype} norm weight (the norm kernels take float32 or bfloat16 "
                        "of the model's dtype)")
        return (GEMMA_RMS if isinstance(module, GemmaRMSNorm) else RMS), [module.weight.detach(), _EMPTY], module.eps
    if isinstance(module, LayerNorm):
        if module.weight is None or tuple(module.normalized_shape) != (module.weight.shape[-1],):
            gaps.append(f"{what}: a LayerNorm without a weight over its last axis")
            return LAYER_NORM, [_EMPTY, _EMPTY], module.eps
        return LAYER_NORM, [module.weight.detach(), _bias(module.bias)], module.eps
    if isinstance(module, HeadLayerNorm):
        return LAYER_NORM, [module.weight.detach(), _EMPTY], module.eps
    gaps.append(f"{what}: a {type(module).__name__}")
    return RMS, [_EMPTY, _EMPTY], None


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


def _router_segments(router: torch.nn.Linear, dtype: torch.dtype) -> list[Segment]:
    """A float layer kept out of packing (a MoE router, a shared expert's gate) as ``row_invariant_linear``
    multiplies it: through its panel copy under batch invariance where the panel kernel takes the dtype,
    else torch's linear over the weight in the model's dtype."""
    bias = _EMPTY if router.bias is None else router.bias.detach().to(dtype)
    panels = row_invariant_panels(router, dtype, router.weight.device)
    if panels is not None:
        return [(PANEL, 0, panels.out_features, panels.data, bias)]
    return [(FLOAT_ROWS, 0, router.out_features, router.weight.detach().to(dtype), bias)]


def _expert_linears(mlp: SparseMoE) -> list[tuple[str, object, bool]]:
    """A mixture's linear layers after qkv and o, in run_layer_stack's order (its ``Moe``)."""
    named: list[tuple[str, object, bool]] = [("router", mlp.gate, False)]
    if mlp.shared_expert is not None:
        named += [("shared gate", mlp.shared_expert_gate, False),
                  ("shared gate_up", mlp.shared_expert.gate_up_proj, True),
                  ("shared down", mlp.shared_expert.down_proj, False)]
    for e, expert in enumerate(mlp.experts):
        named += [(f"expert {e} gate_up", expert.gate_up_proj, True), (f"expert {e} down", expert.down_proj, False)]
    return named


def _linears(ops: LayerOps, dtype: torch.dtype, gaps: list[str]) -> list[list[Segment]]:
    attn, mlp = ops.attention, ops.mlp
    named: list[tuple[str, object, bool]] = [("qkv", attn.qkv_proj, False), ("o", attn.o_proj, False)]
    if isinstance(mlp, GatedMLP):
        named += [("gate_up", mlp.gate_up_proj, True), ("down", mlp.down_proj, False)]
    elif isinstance(mlp, SparseMoE):
        named += _expert_linears(mlp)
    else:
        named += [("fc", mlp.c_fc, False), ("proj", mlp.c_proj, False)]
    linears = []
    for name, linear, gated in named:
        if type(linear) is torch.nn.Linear:  # a router or a shared expert's gate
            linears.append(_router_segments(linear, dtype))
            continue
        if getattr(linear, "tp_size", 1) != 1:
            gaps.append(f"{name}: a tensor-parallel shard (the loop runs whole layers)")
        segments = _segments(linear, gated)
        if segments is None:
            gaps.append(f"{name}: a weight torch or oneDNN multiplies")
            segments = []
        linears.append(segments)
    return linears


def _gated_activation(mlp: GatedMLP, gaps: list[str]) -> int:
    """The activation code of a gated MLP (or expert), its gap added where the loop has no kernel for it."""
    name = mlp.act_and_mul.activation
    kernel = name if name in ACTIVATION_CODES else ACT_AND_MUL_KERNELS.get(name)
    if kernel is None:
        gaps.append(f"MLP: act_and_mul of {name!r}")
        return 0
    return ACTIVATION_CODES[kernel]


def layer_program(layer: DecoderLayer, rope_keys: list, dtype: torch.dtype) -> LayerProgram:
    """The program of one decoder layer; ``rope_keys``: the model's rope tables in order."""
    program = LayerProgram()
    gaps = program.gaps
    if not isinstance(layer, DecoderLayer):
        gaps.append(f"a {type(layer).__name__}")
        return program
    ops = layer.ops
    attn, mlp = ops.attention, ops.mlp
    if dtype not in _KERNEL_DTYPES:
        gaps.append(f"the model's dtype {dtype} (the fused kernels take float32 or bfloat16)")
    paged = attn.attn
    if not paged.use_cpu_kernel:
        gaps.append("attention: the C++ kernels switched off for this layer")
    # A mixture of experts: its number of experts, experts per token, routing and shared expert's size.
    experts = [0, 0, 0, 0]
    swiglu = [0.0, 0.0]  # a clamped SwiGLU's limit and alpha
    if isinstance(mlp, GatedMLP):
        mlp_code = GATED_MLP
        activation = _gated_activation(mlp, gaps)
        intermediate = mlp.down_proj.in_features
    elif isinstance(mlp, SparseMoE):
        mlp_code = MOE
        expert = mlp.experts[0]
        activation = _gated_activation(expert, gaps)
        if mlp.shared_expert is not None and _gated_activation(mlp.shared_expert, gaps) != activation:
            gaps.append("MLP: a shared expert whose activation differs from the experts'")
        intermediate = expert.down_proj.in_features
        routing = TOPK_SOFTMAX if mlp.routing == "topk_softmax" else (
            SOFTMAX_TOPK_NORMALIZED if mlp.normalize else SOFTMAX_TOPK)
        shared = mlp.shared_expert.down_proj.in_features if mlp.shared_expert is not None else 0
        experts = [len(mlp.experts), mlp.top_k, routing, shared]
        if isinstance(expert.act_and_mul, ClampedSwiGLU):
            swiglu = [float(expert.act_and_mul.limit), float(expert.act_and_mul.alpha)]
    elif type(mlp) is PlainMLP:
        mlp_code = PLAIN_MLP
        name = getattr(mlp, "activation", None)
        if name not in PLAIN_ACTIVATION_CODES:
            gaps.append(f"MLP: the activation {name!r}")
        activation = PLAIN_ACTIVATION_CODES.get(name, 0)
        intermediate = mlp.c_proj.in_features
    else:
        gaps.append(f"MLP: a {type(mlp).__name__}")
        return program
    norms = [ops.input_norm, ops.post_attention_norm, ops.pre_feedforward_norm, ops.post_feedforward_norm]
    kinds, epsilons = set(), set()
    for name, module in zip(("input norm", "post-attention norm", "pre-feedforward norm", "post-feedforward norm"),
                            norms):
        kind, tensors, eps = _norm(module, name, dtype, gaps)
        program.norm_tensors += tensors
        if module is not None:
            kinds.add(kind)
            epsilons.add(eps)
    qk_norm = attn.qk_norm
    if qk_norm == NO_QK_NORM:
        qk_kind = RMS
        program.norm_tensors += [_EMPTY] * 4
    else:
        qk_kinds = set()
        for name, module in (("q norm", attn.q_norm), ("k norm", attn.k_norm)):
            kind, tensors, eps = _norm(module, name, dtype, gaps)
            program.norm_tensors += tensors
            qk_kinds.add(kind)
            epsilons.add(eps)
        qk_kind = qk_kinds.pop()
    if len(kinds) > 1:
        gaps.append("norms of different kinds in one layer")
    if len(epsilons) > 1:
        gaps.append(f"norms with different eps {sorted(epsilons)}")
    rope = rope_keys.index(attn.rope_key) if attn.rotates else -1
    program.codes = [ops.wiring, kinds.pop() if kinds else RMS, qk_norm, qk_kind, rope, mlp_code, activation,
                     paged.sliding_window or 0, *experts]
    program.scalars = [float(ops.residual_scale or 0.0), float(paged.logits_soft_cap or 0.0), *swiglu]
    program.linears = _linears(ops, dtype, gaps)
    program.shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim, paged.scale, intermediate,
                     epsilons.pop() if len(epsilons) == 1 else None)
    return program


def gaps_summary(programs: list[LayerProgram]) -> str:
    """Why a model's layers stay on the Python path: each gap once, with the layers it concerns."""
    where: dict[str, list[int]] = {}
    for i, program in enumerate(programs):
        for gap in program.gaps:
            where.setdefault(gap, []).append(i)
    return "; ".join(f"{gap} (layers {_ranges(layers)})" for gap, layers in where.items())


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    spans: list[list[int]] = []
    for layer in layers:
        if spans and layer == spans[-1][1] + 1:
            spans[-1][1] = layer
        else:
            spans.append([layer, layer])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
