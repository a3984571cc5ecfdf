"""A step of a decoder through one C++ call over all its layers (``run_layer_stack`` in
kernels/csrc/layer_stack_cpu.cpp) instead of the per-layer Python, each layer run as its program
(models/layer_program.py) describes it.

A decode step's kernels are short (a few rows), so the Python around them weighs: on the
default model (30 layers) ~25 Python-level operations per layer cost 4-5 ms of a 37 ms bfloat16
step, and as much of a short prompt's step. The C++ loop calls the same kernels with the same
arguments in the same order, so its outputs equal the Python layers' bit for bit. Attention follows
the step's plan (``PagedAttention.cpu_plan``); steps whose plan gives a sequence to torch's SDPA
(float32 prompts), or splits the batch into scattered rows, stay on the Python layers. A model
whose programs have gaps (``layer_program.gaps``: ops with no loop kernel, such as DeepSeek's
experts, tensor-parallel shards or weights multiplied by torch or oneDNN) stays on the Python layers
for every step, and ``stack_report`` says why. Attention sinks (GPT-OSS) go to the attention kernels
with each layer's tensors; sparse mixtures of experts (GPT-OSS, Mixtral, Qwen-MoE) run in the loop,
their routers as ``row_invariant_linear`` multiplies them. Weights may be our
float panels or quantized rows (int8 tiles, packed blocks, float segments, mixed within a layer as
GGUF files mix them). ``PAGEDLLM_LAYER_STACK=0`` turns it off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.attention import AttentionMetadata
from pagedllm.kernels import cpu_kernels, kernel_config
from pagedllm.kernels.codes import DECODE_KERNEL
from pagedllm.kernels.invariance import batch_invariant, int8_amx_min_rows
from pagedllm.models.layer_program import LayerProgram, gaps_summary, layer_program
from pagedllm.quantization.kernels import small_m
from pagedllm.quantization.packed import QuantizedWeight

if TYPE_CHECKING:
    from pagedllm.models.decoder import DecoderModel

_EMPTY = torch.empty(0)
# A step's attention plan for run_layer_stack: per part its kernel, its rows' [begin, end) flattened,
# and its block_tables, query_start_loc and context_lens flattened.
Plan = tuple[list[int], list[int], list[torch.Tensor]]


class LayerStack:
    """The layers' programs gathered once for ``run_layer_stack``; ``run`` adds the step's caches and plan."""

    def __init__(self, model: DecoderModel, module, programs: list[LayerProgram]) -> None:
        self._module = module
        first = model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.intermediate_size, self.eps = (
            programs[0].shape)
        self.windows = [layer.self_attn.attn.sliding_window or 0 for layer in model.layers]
        scores = {(layer.self_attn.attn.logits_soft_cap, layer.self_attn.attn.sinks is None) for layer in model.layers}
        # The first layer's attention plans every layer's step: the plan depends only on the window,
        # the soft cap and whether there are sinks.
        self.planner = first.attn if len(set(self.windows)) == 1 and len(scores) == 1 else None
        self.rope_keys = list(model.rotary)
        self.layer_codes = [code for program in programs for code in program.codes]
        self.layer_scalars = [value for program in programs for value in program.scalars]
        self.norm_tensors = [program.norm_tensors for program in programs]
        # Read at every step: calibration sets the key offsets after the stack is built.
        self.attentions = [layer.self_attn.attn for layer in model.layers]
        self.linear_specs: list[int] = []
        self.linear_tensors: list[torch.Tensor] = []
        for program in programs:
            for segments in program.linears:
                self.linear_specs.append(len(segments))
                for kind, fmt, rows, weight, bias in segments:
                    self.linear_specs += (kind, fmt, rows)
                    self.linear_tensors += (weight, bias)

    def plan(self, meta: AttentionMetadata, hidden: torch.Tensor, k_cache: torch.Tensor) -> Plan | None:
        """The step's attention plan as ``run_layer_stack`` takes it: (kernels, row ranges, tensors),
        or None when the Python layers must run the step."""
        if not all(attn.use_cpu_kernel for attn in self.attentions):
            return None  # switched off since the stack was built (tests compare the torch path)
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
        ropes: dict,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        plan: Plan,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, residual) after the last layer, as the Python layers leave them (residual None
        after post-norm and parallel layers)."""
        tensors = []
        for norms, attn, (k_cache, v_cache) in zip(self.norm_tensors, self.attentions, kv_caches, strict=True):
            tensors += norms
            sinks = attn.sink_logits
            tensors += (k_cache, v_cache, _EMPTY if attn.key_offset is None else attn.key_offset,
                        _EMPTY if sinks is None else sinks)
        rope_tensors = []
        for key in self.rope_keys:
            cos, sin = ropes[key]
            rope_tensors += (cos.squeeze(1), sin.squeeze(1))
        kernels, rows, part_tensors = plan
        return self._module.run_layer_stack(
            hidden, tensors, self.layer_codes, self.layer_scalars, self.linear_specs, self.linear_tensors,
            rope_tensors, meta.slot_mapping, kernels, rows, part_tensors, self.num_heads, self.num_kv_heads,
            self.head_dim, self.intermediate_size, small_m(), int8_amx_min_rows(), self.eps, self.scale,
        )


def model_programs(model: DecoderModel) -> list[LayerProgram]:
    """Every layer's program, with its gaps; a gap in every layer when the shapes differ between layers
    (one call takes one set of sizes) or the loop is off or not built."""
    dtype = model.embed_tokens.weight.dtype
    rope_keys = list(model.rotary)
    programs = [layer_program(layer, rope_keys, dtype) for layer in model.layers]
    shared = []
    if not kernel_config().layer_stack:
        shared.append("the C++ layer loop switched off (PAGEDLLM_LAYER_STACK=0 or the kernel config)")
    module = cpu_kernels()
    if module is None or not hasattr(module, "run_layer_stack"):
        shared.append("no CPU kernels built for this machine")
    if len({program.shape for program in programs}) > 1 or any(p.shape and p.shape[-1] is None for p in programs):
        shared.append("layers of different sizes or norm eps")
    for program in programs:
        program.gaps += shared
    return programs


def stack_report(model: DecoderModel) -> str:
    """Where the model's layers run: "C++ layer loop (N layers)" or "Python layers: <why>"."""
    programs = model_programs(model)
    if programs and not any(program.gaps for program in programs):
        return f"C++ layer loop ({len(programs)} layers)"
    return "Python layers: " + (gaps_summary(programs) or "no layers")


def build_layer_stack(model: DecoderModel) -> LayerStack | None:
    """A LayerStack when the C++ loop runs every layer's program exactly, else None."""
    if not model.layers:
        return None
    programs = model_programs(model)
    if any(program.gaps for program in programs):
        return None
    return LayerStack(model, cpu_kernels(), programs)


def weights_key(model: DecoderModel) -> tuple[int, bool] | None:
    """Names the weights a LayerStack was built over: a new key after repacking or retiling, or when
    batch invariance is switched (routers are multiplied through panels under it, by torch without)."""
    if not model.layers:
        return None
    qkv = model.layers[0].self_attn.qkv_proj
    if qkv.packed_weight is not None or not isinstance(qkv.weight, QuantizedWeight):
        return id(qkv.packed_weight), batch_invariant()
    return id(qkv.weight.segments[0].weight), batch_invariant()
