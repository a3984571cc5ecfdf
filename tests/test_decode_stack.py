"""The C++ decode loop (models/decode_stack.py) against the Python layers: the same logits, bit for
bit, on the models it serves; the Python layers for the models and steps it does not."""

from __future__ import annotations

import pytest
import torch
from test_models import TINY, PagedBatch, make_caches

from pagedllm.attention.cpu_kernels import load_cpu_kernels
from pagedllm.models import build_model, load_model_config
from pagedllm.models.cpu_gemm import panels_supported

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="needs the CPU kernels")


def _build(tmp_path, config, dtype: str):
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # biases and norms away from their initial zeros and ones
        for name, p in hf_model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf_model.save_pretrained(tmp_path)
    model_config = load_model_config(str(tmp_path), dtype=dtype)
    return model_config, build_model(model_config, "cpu")


def _decode_logits(model, model_config, steps: int = 6) -> list[torch.Tensor]:
    """Logits of a batched prefill, then of ``steps`` all-decode steps of four sequences."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 211, (n,), generator=gen).tolist() for n in (7, 13, 1, 5)]
    caches = [(k.to(model_config.dtype), v.to(model_config.dtype)) for k, v in make_caches(model_config)]
    batch = PagedBatch(len(prompts))
    out = []
    with torch.inference_mode():
        positions, meta = batch.step([len(p) for p in prompts])
        ids = torch.tensor([t for p in prompts for t in p])
        out.append(model.compute_logits(model(ids, positions, caches, meta)))
        for _ in range(steps):
            next_ids = out[-1].float().argmax(-1)[-len(prompts):] if len(out) > 1 else torch.tensor([3, 17, 101, 42])
            positions, meta = batch.step([1] * len(prompts))
            out.append(model.compute_logits(model(next_ids, positions, caches, meta)))
    return out


def _without_stack(monkeypatch, model, model_config) -> list[torch.Tensor]:
    monkeypatch.setenv("PAGEDLLM_DECODE_STACK", "0")
    model.model._stack_key = -1  # decide again
    logits = _decode_logits(model, model_config)
    assert model.model._stack is None
    return logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama-gqa", "llama-tied-llama3rope", "qwen2", "mistral-window"])
def test_decode_stack_equals_the_python_layers(name, dtype, tmp_path, monkeypatch):
    """Biases on q/k/v/o (llama-tied-llama3rope, qwen2), GQA, a window narrower than the sequences
    (mistral-window), float32 and bfloat16: every decode step's logits equal the Python layers'."""
    if not panels_supported(getattr(torch, dtype)):
        pytest.skip(f"no packed {dtype} GEMM on this CPU (the stack needs it)")
    config = TINY["mistral"].__class__(**{**TINY["mistral"].to_dict(), "sliding_window": 5}) \
        if name == "mistral-window" else TINY[name]
    model_config, model = _build(tmp_path, config, dtype)
    with_stack = _decode_logits(model, model_config)
    assert model.model._stack is not None  # the decode steps went through the C++ loop
    without = _without_stack(monkeypatch, model, model_config)
    for a, b in zip(with_stack, without, strict=True):
        assert torch.equal(a, b)


def test_models_it_does_not_reproduce_keep_the_python_layers(tmp_path, monkeypatch):
    """Weights left unpacked (the torch GEMM path) give no stack; the steps run as before."""
    monkeypatch.setenv("PAGEDLLM_CPU_GEMM", "torch")
    model_config, model = _build(tmp_path, TINY["llama-gqa"], "float32")
    _decode_logits(model, model_config, steps=1)
    assert model.model._stack is None
