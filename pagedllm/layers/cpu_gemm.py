"""Linear layers on the CPU over weights packed once at load time: our panel kernel or oneDNN.

``F.linear`` on a CPU goes to MKL's sgemm, which re-packs the weight on every call and picks
poor blockings for the shapes serving has (few rows, many output features): measured on a
2-core AVX2 machine, a batch-64 decode step's MLP GEMM (64 x 576 -> 3072) takes 4.8 ms there
and 1.8 ms through oneDNN with a pre-reordered weight; the LM head (64 x 576 -> 49152) 90 ms vs
34 ms. Two packed paths replace it:

- ``panels``: our kernel (kernels/csrc/dense_gemm_cpu.cpp), weights in 32-column panels, AMX
  tiles for bfloat16 where the CPU has them. At decode row counts the work is streaming each
  weight once per step; this kernel reads it at close to the machine's bandwidth where oneDNN
  reaches about two thirds of it (benchmarks/dense_gemm.py).
- ``onednn``: the path torch.compile's CPU backend takes for frozen weights
  (``torch.ops.mkldnn._linear_pointwise`` over ``_reorder_linear_weight``), without compiling.

``kernel_config().gemm`` (``PAGEDLLM_CPU_GEMM``) picks one: ``auto`` (default: panels for float32
at the AVX-512 levels and for bfloat16 at the AMX level, oneDNN otherwise), ``panels``, ``onednn``,
or ``torch`` (F.linear).

``pack_linears(model)`` runs after the weights are loaded. Each ``PackableLinear`` (and the LM
head, through ``lm_head_matmul``) then keeps only the packed copy of its weight: the plain
parameter moves to the meta device (shape and dtype, no memory). A head tied to the embedding
keeps its plain weight too, since the embedding looks rows up in it. float32 results differ from
``F.linear`` in the last bits only (another summation order). bfloat16 takes a packed path only
where the CPU multiplies it natively; elsewhere F.linear stays.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu_kernels, isa_at_least, kernel_config
from pagedllm.kernels.invariance import batch_invariant

logger = logging.getLogger(__name__)


class OneDNNWeight:
    """A weight reordered for oneDNN's inner-product primitive."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.data = torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")


class PanelWeight:
    """A weight packed in column panels for our CPU kernel."""

    def __init__(self, weight: torch.Tensor) -> None:
        self._kernels = cpu_kernels()
        self.out_features, self.in_features = weight.shape
        self.data = self._kernels.dense_pack_weight(weight.detach().contiguous())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._kernels.dense_linear(x, self.data, bias, self.out_features, self.in_features, False)


class GatedPanelWeight(PanelWeight):
    """A gated MLP's stacked [gate; up] weight packed so the kernel's epilogue applies silu(gate) * up:
    rows reordered in blocks of 16, each gate block followed by the up block of the same outputs."""

    BLOCK = 16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self._order = gated_row_order(weight.shape[0], self.BLOCK)
        super().__init__(weight[self._order])
        self._original = torch.argsort(self._order)
        self.bias = None if bias is None else bias.detach()[self._order].contiguous()

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ gate.T + b) * (x @ up.T + b): [..., I]."""
        return self._kernels.dense_linear(x, self.data, self.bias, self.out_features, self.in_features, True)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The plain product, in the weight's own row order (gate, then up)."""
        return super().linear(x, None if bias is None else bias[self._order])[..., self._original]


def gated_row_order(rows: int, block: int) -> torch.Tensor:
    """[gate; up] rows -> gate block 0, up block 0, gate block 1, ... (``rows`` = 2 * I, I % block == 0)."""
    return torch.arange(rows).view(2, rows // (2 * block), block).transpose(0, 1).reshape(-1)


def gated_panels_supported(layer: nn.Module) -> bool:
    """Whether ``pack_linears`` may give this stacked gate/up layer a GatedPanelWeight."""
    return layer.out_features % (2 * GatedPanelWeight.BLOCK) == 0


PackedWeight = OneDNNWeight | PanelWeight


class PackableLinear(nn.Linear):
    """nn.Linear whose forward uses the packed weight once ``pack_linears`` made one."""

    packed_weight: PackedWeight | None = None
    # Set by a gated MLP on its stacked gate/up layer: the activation its output goes through.
    gated_activation: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self, self.bias)


def dense(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ layer.weight.T + bias``, through the packed weight when the layer has one."""
    packed = layer.packed_weight
    if packed is not None:
        return packed.linear(x, bias)
    weight = layer.weight
    if not isinstance(weight, torch.Tensor):  # a QuantizedWeight: packed rows
        return weight.linear(x, bias)
    return F.linear(x, weight, bias)


def row_invariant_linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """``F.linear(x, layer.weight, layer.bias)`` for a float layer kept out of packing and quantizing
    (a MoE router, whose choices must not move). Under batch invariance on a CPU whose panel kernel
    takes the dtype, through a panel copy of the weight made on first use: MKL's product of a row
    depends on the rows around it (a router row alone and among 3 others differed in the last bit,
    which moved the expert weights and so the whole token)."""
    bias = getattr(layer, "bias", None)
    bias = None if bias is None else bias.to(x.dtype)
    panels = row_invariant_panels(layer, x.dtype, x.device)
    if panels is not None:
        return panels.linear(x.contiguous(), bias)
    # .to: a router may compute in float32 over a weight of another dtype.
    return F.linear(x, layer.weight.to(x.dtype), bias)


def row_invariant_panels(layer: nn.Module, dtype: torch.dtype, device: torch.device) -> PanelWeight | None:
    """The panel copy ``row_invariant_linear`` multiplies ``layer`` through for activations of ``dtype``
    (made on first use), or None where it takes F.linear."""
    if device.type != "cpu" or not batch_invariant() or not panels_supported(dtype):
        return None
    panels = getattr(layer, "_row_invariant_panels", None)
    if panels is None or panels.data.dtype != dtype:
        panels = layer._row_invariant_panels = PanelWeight(layer.weight.to(dtype))
    return panels


def cpu_gemm_path(device: torch.device, dtype: torch.dtype) -> str | None:
    """"panels", "onednn", or None (F.linear) for weights of this dtype on this device."""
    choice = kernel_config().gemm
    if device.type != "cpu" or choice == "torch" or dtype not in (torch.float32, torch.bfloat16):
        return None
    if choice in ("auto", "panels") and panels_supported(dtype):
        # bfloat16 without AMX multiplies through vdpbf16ps, slower than oneDNN past a few rows; but
        # oneDNN's product of a row depends on how many rows come with it (kernels/invariance.py)
        if choice == "panels" or dtype == torch.float32 or isa_at_least("amx") or batch_invariant():
            return "panels"
    return "onednn" if onednn_supported(dtype) else None


def cpu_gemm_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    return cpu_gemm_path(device, dtype) is not None


def panels_supported(dtype: torch.dtype) -> bool:
    """Whether our panel kernel multiplies this dtype on this CPU."""
    kernels = cpu_kernels()
    return kernels is not None and kernels.dense_gemm_supported(torch.empty(0, dtype=dtype))


def onednn_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN's reordered-weight path takes this dtype on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_has_fast_bf16() -> bool:
    """Native bfloat16 matmul instructions (AVX-512 BF16 or AMX) at the kernels' level; elsewhere
    bf16 is emulated and slow.

    ``cpu_bf16=False`` (``PAGEDLLM_CPU_BF16=0``) answers no on any CPU, so that ``dtype="auto"``
    keeps float32 (the test suite does this: its oracle is transformers in float32)."""
    return kernel_config().cpu_bf16 and isa_at_least("avx512_bf16")


def pack_weight(weight: torch.Tensor, path: str) -> PackedWeight:
    return PanelWeight(weight) if path == "panels" else OneDNNWeight(weight)


def pack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Give every PackableLinear and the LM head (``model.logits_head()``) a packed weight.

    Returns how many weights were packed (0 when the path is off for this device / dtype).
    """
    path = cpu_gemm_path(device, dtype)
    if path is None:
        return 0
    count = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, PackableLinear) and isinstance(module.weight, torch.Tensor):
                if path == "panels" and module.gated_activation in ("silu", "swish") and gated_panels_supported(module):
                    module.packed_weight = GatedPanelWeight(module.weight, module.bias)
                else:
                    module.packed_weight = pack_weight(module.weight, path)
                _drop_plain_weight(module)
                count += 1
        head = model.logits_head()
        if isinstance(head.weight, torch.Tensor):
            head.packed_weight = pack_weight(head.weight, path)
            if not getattr(model, "tie_word_embeddings", False):
                _drop_plain_weight(head)  # a tied head is also the embedding, which looks rows up
            count += 1
    logger.info("CPU GEMM: %d linear weights packed for the %s path", count, path)
    return count


def _drop_plain_weight(module: nn.Module) -> None:
    """Keep one copy of the weight: the packed one. The parameter stays, on the meta device, so
    the module still reports its shape and dtype."""
    weight = module.weight
    module.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False)


def lm_head_matmul(hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
    """``hidden @ head.weight.T`` (the LM head, or the tied embedding serving as one)."""
    packed = getattr(head, "packed_weight", None)
    if packed is not None:
        return packed.linear(hidden, None)
    if not isinstance(head.weight, torch.Tensor):  # a QuantizedWeight: packed rows
        return head.weight.linear(hidden, None)
    return torch.matmul(hidden, head.weight.t())
