"""The packed linear paths (layers/cpu_gemm.py: oneDNN, our panel kernel) against F.linear and the torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import KernelConfig, cpu_kernels, use_kernel_config
from pagedllm.layers.cpu_gemm import (
    GatedPanelWeight,
    OneDNNWeight,
    PackableLinear,
    PanelWeight,
    cpu_gemm_enabled,
    cpu_gemm_path,
    dense,
    pack_linears,
    panels_supported,
)
from pagedllm.models import build_model, load_model_config

ONEDNN = torch.backends.mkldnn.is_available()


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN")
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    layer = PackableLinear(96, 200, bias=bias).eval()
    x = torch.randn(rows, 96)
    with torch.no_grad():
        expected = F.linear(x, layer.weight, layer.bias)
        assert layer.packed_weight is None
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)  # unpacked: F.linear itself
        layer.packed_weight = OneDNNWeight(layer.weight)
        out = dense(x, layer, layer.bias)
    assert out.shape == (rows, 200)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (out, in): AMX needs in % 32 == 0
@pytest.mark.parametrize("shape", [(200, 96), (70, 576), (33, 1536), (40, 45), (40, 131)])
@pytest.mark.parametrize("rows", [1, 5, 16, 31, 32, 45, 64, 300])
def test_panel_kernel_matches_float64(dtype: torch.dtype, shape: tuple[int, int], rows: int, kernel_level) -> None:
    """The panel kernel over every tail: outputs not a multiple of 32, odd inputs (alone and after
    whole chunks of inputs), row blocks; at every level, on the branch that level compiles."""
    if not panels_supported(dtype):
        assert not kernel_level.has(_panel_kernel(dtype, shape[1], kernel_level))
        pytest.skip(f"no panel kernel for {dtype} at the {kernel_level.level} level")
    torch.manual_seed(rows)
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    x = torch.randn(rows, in_features).to(dtype)
    packed = PanelWeight(weight)
    y = packed.linear(x, bias)
    assert y.shape == (rows, out_features) and y.dtype == dtype
    expected = x.double() @ weight.double().T + bias.double()
    # float32: summation order only; bfloat16: one rounding of the float32 sum
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert (y.double() - expected).abs().max().item() < tol * expected.abs().max().item()
    assert torch.equal(packed.linear(x.view(rows, 1, in_features), bias).view(rows, out_features), y)
    if dtype == torch.float32:  # the bias is added to the finished sum
        torch.testing.assert_close(packed.linear(x, None) + bias, y, rtol=0, atol=0)
    kernel_level.assert_ran(_panel_kernel(dtype, in_features, kernel_level))


def _panel_kernel(dtype: torch.dtype, in_features: int, kernel_level) -> str:
    """The kernel name (kernel_levels.EXPECTED_BRANCHES) a panel product of this dtype runs at a level."""
    if dtype == torch.float32:
        return "dense_gemm_f32"
    amx = kernel_level.has("dense_gemm_bf16_amx") and in_features % 32 == 0
    return "dense_gemm_bf16_amx" if amx else "dense_gemm_bf16"


@pytest.mark.kernels(level="avx512")  # the float32 panel kernel
def test_panel_kernel_rows_do_not_depend_on_their_batch() -> None:
    """A row's float32 result is one sequential sum: the same alone as in any batch."""
    torch.manual_seed(0)
    weight = torch.randn(100, 96)
    x = torch.randn(40, 96)
    packed = PanelWeight(weight)
    batch = packed.linear(x, None)
    for i in (0, 13, 39):
        assert torch.equal(packed.linear(x[i : i + 1], None)[0], batch[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [576, 40])
@pytest.mark.parametrize("rows", [1, 7, 33, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_panels_equal_the_unfused_layers(dtype: torch.dtype, in_features: int, rows: int, bias: bool,
                                               kernel_level) -> None:
    """silu(gate) * up in the GEMM's epilogue: the same bits as the GEMM, then the silu_and_mul kernel."""
    if not panels_supported(dtype):
        pytest.skip(f"no panel kernel for {dtype} at the {kernel_level.level} level")
    torch.manual_seed(rows)
    width = 96
    weight = (torch.randn(2 * width, in_features) / 8).to(dtype)
    b = torch.randn(2 * width).to(dtype) if bias else None
    x = torch.randn(rows, in_features).to(dtype)
    gated, plain = GatedPanelWeight(weight, b), PanelWeight(weight)
    unfused = plain.linear(x, b)
    assert torch.equal(gated.linear(x, b), unfused)  # the plain product, in the weight's own row order
    assert torch.equal(gated.silu_and_mul(x), cpu_kernels().silu_and_mul(unfused))
    kernel_level.assert_ran(_panel_kernel(dtype, in_features, kernel_level), "fused_ops")


def test_gemm_path_choice(kernel_level) -> None:
    """Which path ``auto`` takes follows the level: panels for float32 from AVX-512 on, for
    bfloat16 with AMX only when batch invariance is off (oneDNN beats vdpbf16ps past a few rows);
    oneDNN below."""
    cpu = torch.device("cpu")
    assert not cpu_gemm_enabled(torch.device("meta"), torch.float32)
    assert not cpu_gemm_enabled(cpu, torch.float16)
    fallback = "onednn" if ONEDNN else None
    assert cpu_gemm_path(cpu, torch.float32) == ("panels" if kernel_level.has("dense_gemm_f32") else fallback)
    bf16_fallback = "onednn" if ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported() else None
    # Under batch invariance (the default) bfloat16 takes the panels wherever they exist: oneDNN's
    # product of a row can depend on how many rows come with it.
    assert cpu_gemm_path(cpu, torch.bfloat16) == ("panels" if kernel_level.has("dense_gemm_bf16") else bf16_fallback)
    with use_kernel_config(batch_invariant=False):
        bf16_auto = "panels" if kernel_level.has("dense_gemm_bf16_amx") else bf16_fallback
        assert cpu_gemm_path(cpu, torch.bfloat16) == bf16_auto
    if kernel_level.has("dense_gemm_bf16"):
        with use_kernel_config(gemm="panels"):
            assert cpu_gemm_path(cpu, torch.bfloat16) == "panels"
    if ONEDNN:
        with use_kernel_config(gemm="onednn"):
            assert cpu_gemm_path(cpu, torch.float32) == "onednn"
    with use_kernel_config(gemm="torch"):
        assert not cpu_gemm_enabled(cpu, torch.float32)
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_GEMM='mkl'"):
        KernelConfig(gemm="mkl")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_GEMM='mkl'"):
        KernelConfig.from_env({"PAGEDLLM_CPU_GEMM": "mkl"})


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN")
def test_packed_model_equals_torch_path(tiny_model_factory) -> None:
    """Every linear and the LM head packed; logits equal the F.linear build's to float32 rounding."""
    config = load_model_config(tiny_model_factory("llama"), dtype="float32")
    packed = build_model(config, "cpu")
    with use_kernel_config(gemm="torch"):
        plain = build_model(config, "cpu")
        assert pack_linears(plain, torch.device("cpu"), torch.float32) == 0  # still off: gemm="torch"
    linears = [m for m in packed.modules() if isinstance(m, PackableLinear)]
    assert linears and all(m.packed_weight is not None for m in linears)
    assert packed.logits_head().packed_weight is not None
    assert all(m.packed_weight is None for m in plain.modules() if isinstance(m, PackableLinear))
    assert getattr(plain.logits_head(), "packed_weight", None) is None
    ids = torch.tensor([5, 9, 2, 77, 31, 8])
    with torch.inference_mode():
        logits = [m.compute_logits(m(ids, torch.arange(len(ids)), None, None)) for m in (packed, plain)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
