"""The C++ loop over a decoder's layers (models/layer_stack.py) against the Python layers: the same
logits, bit for bit, on the models and steps it serves; the Python layers for the others."""

from __future__ import annotations

import pytest
import torch
from test_models import TINY, PagedBatch, make_caches

from pagedllm.attention.backend import AMX_KERNEL, CHUNKED_KERNEL, DECODE_KERNEL
from pagedllm.attention.cpu_kernels import load_cpu_kernels, prompt_attention_amx_supported
from pagedllm.models import build_model, load_model_config
from pagedllm.models.cpu_gemm import panels_supported
from pagedllm.models.layer_stack import LayerStack

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


CONFIGS = {
    "mistral-window": transformers.MistralConfig(**{**TINY["mistral"].to_dict(), "sliding_window": 5}),
    # Heads of 64: what the AMX prompt kernel takes.
    "llama-head64": transformers.LlamaConfig(hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1, vocab_size=211,
                                             max_position_embeddings=256, initializer_range=0.2),
}

# Per step, each sequence's new tokens: a batched prefill (one prompt of a single token), decodes,
# a prompt chunk of 70 after its context beside three decodes (the engine puts decodes first), and a
# short chunk after its context among decodes.
STEPS = [(7, 13, 1, 5), (1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 70), (1, 1, 1, 1), (1, 1, 6, 1), (1, 1, 1, 1)]


def _step_logits(model, model_config) -> list[torch.Tensor]:
    """Logits of every step of STEPS over four sequences (the same token ids on every call)."""
    gen = torch.Generator().manual_seed(1)
    caches = [(k.to(model_config.dtype), v.to(model_config.dtype)) for k, v in make_caches(model_config, 64)]
    batch = PagedBatch(4, num_blocks=64)
    out = []
    with torch.inference_mode():
        for new_tokens in STEPS:
            positions, meta = batch.step(list(new_tokens))
            ids = torch.randint(2, 211, (sum(new_tokens),), generator=gen)
            out.append(model.compute_logits(model(ids, positions, caches, meta)))
    return out


def _count_stack_runs(monkeypatch) -> list[list[int]]:
    """The attention kernels of each step the C++ loop runs, recorded."""
    runs = []
    run = LayerStack.run

    def recorded(self, hidden, rope, kv_caches, meta, plan):
        runs.append(list(plan[0]))
        return run(self, hidden, rope, kv_caches, meta, plan)

    monkeypatch.setattr(LayerStack, "run", recorded)
    return runs


def _without_stack(monkeypatch, model, model_config) -> list[torch.Tensor]:
    monkeypatch.setenv("PAGEDLLM_LAYER_STACK", "0")
    model.model._stack_key = -1  # decide again
    logits = _step_logits(model, model_config)
    assert model.model._stack is None
    return logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama-gqa", "llama-tied-llama3rope", "qwen2", "mistral-window", "llama-head64"])
def test_layer_stack_equals_the_python_layers(name, dtype, tmp_path, monkeypatch):
    """Biases on q/k/v/o (llama-tied-llama3rope, qwen2), GQA, a window narrower than the sequences
    (mistral-window), float32 and bfloat16, decodes and prompt chunks: every step's logits equal
    the Python layers'."""
    if not panels_supported(getattr(torch, dtype)):
        pytest.skip(f"no packed {dtype} GEMM on this CPU (the stack needs it)")
    config = CONFIGS[name] if name in CONFIGS else TINY[name]
    model_config, model = _build(tmp_path, config, dtype)
    runs = _count_stack_runs(monkeypatch)
    with_stack = _step_logits(model, model_config)
    # Every decode step and the short chunk among decodes went through the C++ loop; with AMX, the
    # bfloat16 70-token chunk beside decodes too, in two parts (a window narrower than the chunk
    # sends it to the chunked kernel with the rest).
    assert runs.count([DECODE_KERNEL]) == 4 and [CHUNKED_KERNEL] in runs
    bf16 = torch.empty(1, model_config.head_dim, dtype=torch.bfloat16)
    if dtype == "bfloat16" and name != "mistral-window" and prompt_attention_amx_supported(bf16, bf16):
        assert [AMX_KERNEL, CHUNKED_KERNEL] in runs
    without = _without_stack(monkeypatch, model, model_config)
    for a, b in zip(with_stack, without, strict=True):
        assert torch.equal(a, b)


def test_models_it_does_not_reproduce_keep_the_python_layers(tmp_path, monkeypatch):
    """Weights left unpacked (the torch GEMM path) give no stack; the steps run as before."""
    monkeypatch.setenv("PAGEDLLM_CPU_GEMM", "torch")
    model_config, model = _build(tmp_path, TINY["llama-gqa"], "float32")
    _step_logits(model, model_config)
    assert model.model._stack is None
