"""The fused CPU kernels of the decoder's elementwise chains against the torch code they replace."""

from __future__ import annotations

import pytest
import torch
from requirements_here import require_kernels

from pagedllm.layers import fused_ops
from pagedllm.layers.norms_and_activations import ActAndMul, GemmaRMSNorm, RMSNorm, get_activation
from pagedllm.models.rotary import apply_rotary, rotate_heads

DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # bfloat16: a rounding step or two apart at most (float math in another order can round an
    # intermediate the other way).
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-3}


def _norm(gemma: bool, width: int, dtype: torch.dtype) -> RMSNorm:
    norm = (GemmaRMSNorm if gemma else RMSNorm)(width, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width) * 0.5 + (0.0 if gemma else 1.0))
    return norm.to(dtype)


def _wide_rows(rows: int, width: int, dtype: torch.dtype, extra: int = 7) -> torch.Tensor:
    """[rows, width] whose rows sit `extra` values apart (a slice of a wider tensor)."""
    return torch.randn(rows, width + extra).to(dtype)[:, :width]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("rows,width", [(1, 576), (67, 37), (300, 576)])
@torch.inference_mode()
def test_rms_norm(dtype, gemma, rows, width, kernel_level) -> None:
    norm = _norm(gemma, width, dtype)
    for x in (torch.randn(rows, width).to(dtype), _wide_rows(rows, width, dtype)):
        out = fused_ops.rms_norm(x, norm.weight, norm.eps, gemma)
        assert out is not None and out.is_contiguous() and out.dtype == dtype
        torch.testing.assert_close(out, norm.reference(x), **_tol(dtype))
        assert norm(x).dtype == dtype
    kernel_level.assert_ran("fused_ops")


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_rms_norm_of_heads_in_a_fused_projection(dtype, kernel_level) -> None:
    """Qwen3's per-head q norm: [T, heads, head_dim] viewed out of the fused qkv output."""
    tokens, heads, head_dim = 5, 3, 64
    qkv = torch.randn(tokens, (heads + 2) * head_dim).to(dtype)
    q = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    assert not q.is_contiguous()
    norm = _norm(False, head_dim, dtype)
    torch.testing.assert_close(norm(q), norm.reference(q), **_tol(dtype))
    kernel_level.assert_ran("fused_ops")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("rows,width", [(1, 576), (64, 37), (300, 576)])
@torch.inference_mode()
def test_fused_add_rms_norm_in_place(dtype, gemma, rows, width, kernel_level) -> None:
    norm = _norm(gemma, width, dtype)
    x, residual = torch.randn(rows, width).to(dtype), _wide_rows(rows, width, dtype)
    expected_residual = x + residual
    expected = norm.reference(expected_residual)
    out, new_residual = norm(x, residual)
    assert out is x and new_residual is residual  # overwritten in place, as vLLM's kernel
    torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, **_tol(dtype))
    kernel_level.assert_ran("fused_ops")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh", "gelu"])
@pytest.mark.parametrize("rows,width", [(1, 1536), (64, 37), (256, 1536)])
@torch.inference_mode()
def test_act_and_mul(dtype, activation, rows, width, kernel_level) -> None:
    act = get_activation(activation)
    for x in (torch.randn(rows, 2 * width).to(dtype) * 3, _wide_rows(rows, 2 * width, dtype)):
        out = fused_ops.act_and_mul(x, activation)
        assert out is not None and out.shape == (rows, width)
        gate, up = x.split(width, dim=-1)
        torch.testing.assert_close(out, act(gate) * up, **_tol(dtype))
    assert fused_ops.act_and_mul(x, "relu") is None
    torch.testing.assert_close(ActAndMul("relu")(x), torch.relu(gate) * up)
    kernel_level.assert_ran("fused_ops")


def _cos_sin(tokens: int, rotary_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin laid out as RotaryEmbedding.cos_sin returns them: [T, 1, rotary_dim // 2]
    views of one [T, 1, rotary_dim] table."""
    angles = torch.rand(tokens, rotary_dim // 2) * 100
    table = torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)
    cos, sin = table.unsqueeze(1).chunk(2, dim=-1)
    return cos, sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (64, 32), (80, 20)])
@torch.inference_mode()
def test_rotary_in_place_on_fused_qkv(dtype, tokens, head_dim, rotary_dim, kernel_level) -> None:
    """q and k heads rotated in place inside the fused qkv output; v and the channels past a
    partial rotary width untouched."""
    q_heads, kv_heads = 9, 3
    qk_width = (q_heads + kv_heads) * head_dim
    qkv = torch.randn(tokens, qk_width + kv_heads * head_dim).to(dtype)
    before = qkv.clone()
    cos, sin = _cos_sin(tokens, rotary_dim, dtype)
    heads = qkv[:, :qk_width].view(tokens, -1, head_dim)
    expected = apply_rotary(heads.clone(), cos, sin)
    out = rotate_heads(heads, cos, sin)
    assert out.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(out, expected, **_tol(dtype))
    assert torch.equal(qkv[:, qk_width:], before[:, qk_width:])
    passthrough = out[..., rotary_dim:]
    assert torch.equal(passthrough, before[:, :qk_width].view(tokens, -1, head_dim)[..., rotary_dim:])
    kernel_level.assert_ran("fused_ops")


@torch.inference_mode()
def test_other_dtypes_and_devices_take_the_torch_path() -> None:
    x, w = torch.randn(4, 16), torch.ones(16)
    assert fused_ops.rms_norm(x.double(), w.double(), 1e-6, False) is None
    assert fused_ops.rms_norm(x.half(), w.half(), 1e-6, False) is None
    assert fused_ops.rms_norm(x, w.bfloat16(), 1e-6, False) is None  # mixed dtypes
    assert fused_ops.rms_norm(x.to("meta"), w.to("meta"), 1e-6, False) is None
    assert not fused_ops.fused_add_rms_norm(x.double(), x.double(), w.double(), 1e-6, False)
    assert fused_ops.act_and_mul(x.double(), "silu") is None
    cos, sin = _cos_sin(4, 16, torch.float64)
    assert not fused_ops.rotary_embedding_(x.double().view(4, 1, 16), cos, sin)
    norm = RMSNorm(16, 1e-6).double()
    out, residual = norm(x.double(), x.double())
    torch.testing.assert_close(residual, 2 * x.double())
    torch.testing.assert_close(out, norm.reference(2 * x.double()))


def test_autograd_takes_the_torch_path() -> None:
    norm = RMSNorm(16, 1e-6)
    x = torch.randn(4, 16)
    assert fused_ops.rms_norm(x, norm.weight, 1e-6, False) is None  # the weight requires grad
    norm(x).sum().backward()
    assert norm.weight.grad is not None


@torch.inference_mode()
def test_bad_shapes_are_refused_by_the_kernel() -> None:
    kernels = require_kernels()
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6, False)
    with pytest.raises(RuntimeError, match="2 \\* width"):
        kernels.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="exceeds head_dim"):
        kernels.rotary_embedding_inplace(torch.randn(2, 1, 8), torch.ones(2, 8), torch.ones(2, 8))
