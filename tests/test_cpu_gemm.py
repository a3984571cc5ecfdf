"""The oneDNN reordered-weight linear path (models/cpu_gemm.py) against F.linear and the torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.models import build_model, load_model_config
from pagedllm.models.cpu_gemm import PackableLinear, cpu_gemm_enabled, dense, pack_linears

ONEDNN = cpu_gemm_enabled(torch.device("cpu"), torch.float32)


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
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight)
        out = dense(x, layer, layer.bias)
    assert out.shape == (rows, 200)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_gemm_path_choice(monkeypatch) -> None:
    assert not cpu_gemm_enabled(torch.device("meta"), torch.float32)
    assert not cpu_gemm_enabled(torch.device("cpu"), torch.float16)
    monkeypatch.setenv("PAGEDLLM_CPU_GEMM", "torch")
    assert not cpu_gemm_enabled(torch.device("cpu"), torch.float32)


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN")
def test_packed_model_equals_torch_path(tiny_model_factory, monkeypatch) -> None:
    """Every linear and the LM head packed; logits equal the F.linear build's to float32 rounding."""
    config = load_model_config(tiny_model_factory("llama"), dtype="float32")
    packed = build_model(config, "cpu")
    monkeypatch.setenv("PAGEDLLM_CPU_GEMM", "torch")
    plain = build_model(config, "cpu")
    linears = [m for m in packed.modules() if isinstance(m, PackableLinear)]
    assert linears and all(m.packed_weight is not None for m in linears)
    assert packed.logits_head().packed_weight is not None
    assert all(m.packed_weight is None for m in plain.modules() if isinstance(m, PackableLinear))
    assert getattr(plain.logits_head(), "packed_weight", None) is None
    assert pack_linears(plain, torch.device("cpu"), torch.float32) == 0  # still off: the variable is set
    ids = torch.tensor([5, 9, 2, 77, 31, 8])
    with torch.inference_mode():
        logits = [m.compute_logits(m(ids, torch.arange(len(ids)), None, None)) for m in (packed, plain)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
