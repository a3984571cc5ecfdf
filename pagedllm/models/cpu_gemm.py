"""Linear layers on the CPU through oneDNN with weights reordered once at load time.

``F.linear`` on a CPU goes to MKL's sgemm, which re-packs the weight on every call and picks
poor blockings for the shapes serving has (few rows, many output features): measured on this
2-core AVX2 machine, a batch-64 decode step's MLP GEMM (64 x 576 -> 3072) takes 4.8 ms there
and 1.8 ms through oneDNN with a pre-reordered weight; the LM head (64 x 576 -> 49152) 90 ms vs
34 ms. This is the same oneDNN path torch.compile's CPU backend takes for frozen weights
(``torch.ops.mkldnn._linear_pointwise``), without compiling anything.

``pack_linears(model)`` runs after the weights are loaded. Each ``PackableLinear`` (and the LM
head, through ``lm_head_matmul``) then keeps only the reordered copy of its weight: the plain
parameter moves to the meta device (shape and dtype, no memory). A head tied to the embedding
keeps its plain weight too, since the embedding looks rows up in it. float32 results differ from
``F.linear`` in the last bits only (another summation order). bfloat16 takes this path only
where oneDNN supports it (AVX-512 / AMX / AVX-NE-CONVERT); elsewhere F.linear stays.
``PAGEDLLM_CPU_GEMM=torch`` turns the whole path off.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


class PackableLinear(nn.Linear):
    """nn.Linear whose forward uses the oneDNN-reordered weight once ``pack_linears`` made one."""

    packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self, self.bias)


def dense(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ layer.weight.T + bias``, through the packed weight when the layer has one."""
    packed = layer.packed_weight
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    weight = layer.weight
    if not isinstance(weight, torch.Tensor):  # a QuantizedWeight: packed rows
        return weight.linear(x, bias)
    return F.linear(x, weight, bias)


def cpu_gemm_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or os.environ.get("PAGEDLLM_CPU_GEMM", "onednn") == "torch":
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def cpu_has_fast_bf16() -> bool:
    """Native bfloat16 matmul instructions (AVX-512 BF16 or AMX); elsewhere bf16 is emulated and slow.

    ``PAGEDLLM_CPU_BF16=0`` answers no on any CPU, so that ``dtype="auto"`` keeps float32 (the
    test suite does this: its oracle is transformers in float32)."""
    if os.environ.get("PAGEDLLM_CPU_BF16", "1") == "0":
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def reorder_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def pack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Give every PackableLinear and the LM head (``model.logits_head()``) a reordered weight.

    Returns how many weights were packed (0 when the path is off for this device / dtype).
    """
    if not cpu_gemm_enabled(device, dtype):
        return 0
    count = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, PackableLinear) and isinstance(module.weight, torch.Tensor):
                module.packed_weight = reorder_weight(module.weight)
                _drop_plain_weight(module)
                count += 1
        head = model.logits_head()
        if isinstance(head.weight, torch.Tensor):
            head.packed_weight = reorder_weight(head.weight)
            if not getattr(model, "tie_word_embeddings", False):
                _drop_plain_weight(head)  # a tied head is also the embedding, which looks rows up
            count += 1
    logger.info("oneDNN: %d linear weights reordered for the CPU", count)
    return count


def _drop_plain_weight(module: nn.Module) -> None:
    """Keep one copy of the weight: the reordered one. The parameter stays, on the meta device, so
    the module still reports its shape and dtype."""
    weight = module.weight
    module.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False)


def lm_head_matmul(hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
    """``hidden @ head.weight.T`` (the LM head, or the tied embedding serving as one)."""
    packed = getattr(head, "packed_weight", None)
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(hidden, packed, None, "none", [], "")
    if not isinstance(head.weight, torch.Tensor):  # a QuantizedWeight: packed rows
        return head.weight.linear(hidden, None)
    return torch.matmul(hidden, head.weight.t())
