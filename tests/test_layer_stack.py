"""The C++ loop over a decoder's layers (models/layer_stack.py) against the Python layers: the same
logits, bit for bit, on the models and steps it serves; the Python layers for the others."""

from __future__ import annotations

import pytest
import torch
from gguf_models import write_tiny_llama_gguf
from requirements_here import require
from test_models import TINY, PagedBatch, make_caches

from pagedllm.kernels import cpu_kernels, kernel_config, use_kernel_config
from pagedllm.kernels.attention import prompt_attention_amx_supported
from pagedllm.kernels.codes import AMX_KERNEL, CHUNKED_KERNEL, DECODE_KERNEL, FLOAT_ROWS, INT8_TILED, QUANT_BLOCKS
from pagedllm.layers.cpu_gemm import cpu_gemm_path, panels_supported
from pagedllm.models import build_model, load_model_config
from pagedllm.models.layer_stack import LayerStack
from pagedllm.quantization.int8_tiles import int8_tiling_reason

transformers = require("transformers")

pytestmark = pytest.mark.kernels


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


def _without_stack(model, model_config) -> list[torch.Tensor]:
    with use_kernel_config(layer_stack=False):
        model.model._stack_key = -1  # decide again
        logits = _step_logits(model, model_config)
    assert model.model._stack is None
    return logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama-gqa", "llama-tied-llama3rope", "qwen2", "mistral-window", "llama-head64"])
def test_layer_stack_equals_the_python_layers(name, dtype, tmp_path, monkeypatch, kernel_level):
    """Biases on q/k/v/o (llama-tied-llama3rope, qwen2), GQA, a window narrower than the sequences
    (mistral-window), float32 and bfloat16, decodes and prompt chunks: every step's logits equal
    the Python layers'. At each level: what ``auto`` does there (the stack over our panels, or
    oneDNN's weights and the Python layers), then the stack forced onto the panels where that
    level's kernels have them."""
    config = CONFIGS[name] if name in CONFIGS else TINY[name]
    if cpu_gemm_path(torch.device("cpu"), getattr(torch, dtype)) != "panels":
        model_config, model = _build(tmp_path / "auto", config, dtype)
        _step_logits(model, model_config)
        assert model.model._stack is None  # the weights are oneDNN's or torch's: no stack
        if not panels_supported(getattr(torch, dtype)):
            pytest.skip(f"no packed {dtype} GEMM at the {kernel_level.level} level (the stack needs it)")
    with use_kernel_config(gemm="panels"):
        _check_stack_equals_the_python_layers(name, config, dtype, tmp_path / "panels", monkeypatch)
        with use_kernel_config(batch_invariant=False):
            _check_stack_equals_the_python_layers(name, config, dtype, tmp_path / "variant", monkeypatch)
    # With AMX, every bfloat16 product goes through tile multiplies (dense_gemm_cpu.cpp).
    bf16_gemm = "dense_gemm_bf16_amx" if kernel_level.branch("dense_gemm_bf16_amx") != "none" else "dense_gemm_bf16"
    kernel_level.assert_ran("paged_decode_attention", "paged_chunked_attention", "fused_ops",
                            "dense_gemm_f32" if dtype == "float32" else bf16_gemm)


def _check_stack_equals_the_python_layers(name, config, dtype, tmp_path, monkeypatch) -> None:
    model_config, model = _build(tmp_path, config, dtype)
    runs = _count_stack_runs(monkeypatch)
    with_stack = _step_logits(model, model_config)
    if kernel_config().batch_invariant:
        # Every step through the C++ loop, every row attended by the decode kernel.
        assert runs == [[DECODE_KERNEL]] * len(STEPS)
    else:
        # Every decode step and the short chunk among decodes went through the C++ loop; with AMX,
        # the bfloat16 70-token chunk beside decodes too, in two parts (a window narrower than the
        # chunk sends it to the chunked kernel with the rest).
        assert runs.count([DECODE_KERNEL]) == 4 and [CHUNKED_KERNEL] in runs
        bf16 = torch.empty(1, model_config.head_dim, dtype=torch.bfloat16)
        if dtype == "bfloat16" and name != "mistral-window" and prompt_attention_amx_supported(bf16, bf16):
            assert [AMX_KERNEL, CHUNKED_KERNEL] in runs
    without = _without_stack(model, model_config)
    for a, b in zip(with_stack, without, strict=True):
        assert torch.equal(a, b)


# Segments of several kinds within a layer, as GGUF files mix them: q and k in Q4_K beside v in float32,
# gate in Q4_K beside up in Q8_0, down in Q6_K.
MIXED = {"default": "Q4_K", "attn_v": "F32", "ffn_down": "Q6_K", "ffn_up": "Q8_0"}


@pytest.mark.parametrize(("types", "dtype", "int8"), [
    ("Q4_1", "float32", None), ("mixed", "float32", False), ("mixed", "float32", True), ("mixed", "bfloat16", False),
])
def test_layer_stack_over_quantized_weights(types, dtype, int8, tmp_path, monkeypatch, kernel_level):
    """GGUF weights kept packed (the default model's case), multiplied by int8 tiles or by the
    float-activation block kernels, one or several segments per layer: the same logits as the
    Python layers, bit for bit, at every level."""
    if int8 and int8_tiling_reason(torch.device("cpu")) is not None:
        pytest.skip(f"{kernel_level.level}: {int8_tiling_reason(torch.device('cpu'))}")
    path = write_tiny_llama_gguf(str(tmp_path / "model.gguf"), MIXED if types == "mixed" else types, 211)
    model_config = load_model_config(path, dtype=dtype)
    model_config.int8_activations = int8
    model = build_model(model_config, "cpu")
    runs = _count_stack_runs(monkeypatch)
    with_stack = _step_logits(model, model_config)
    assert runs == [[DECODE_KERNEL]] * len(STEPS)  # every step through the loop (batch invariance)
    layers = _segment_kinds(model.model._stack.linear_specs)
    packed = INT8_TILED if int8 is not False and int8_tiling_reason(torch.device("cpu")) is None else QUANT_BLOCKS
    if types == "mixed":  # q+k, v | o | gate, up | down (Q8_0 is tiled only where VNNI multiplies it)
        assert layers[0][:2] == [[packed, FLOAT_ROWS], [packed]] and len(layers[0][2]) == 2
    else:
        assert layers[0] == [[packed]] * 4
    without = _without_stack(model, model_config)
    for a, b in zip(with_stack, without, strict=True):
        assert torch.equal(a, b)
    kernel_level.assert_ran("paged_decode_attention", "int8_linear_dot" if packed == INT8_TILED else "quant_linear")
    kernel_level.assert_not_ran("paged_chunked_attention")


def _segment_kinds(specs: list[int]) -> list[list[list[int]]]:
    """Per layer, per linear layer, its segments' kinds, read back from LayerStack.linear_specs."""
    linears, at = [], 0
    while at < len(specs):
        count = specs[at]
        linears.append([specs[at + 1 + 3 * i] for i in range(count)])
        at += 1 + 3 * count
    return [linears[i:i + 4] for i in range(0, len(linears), 4)]


def test_models_it_does_not_reproduce_keep_the_python_layers(tmp_path):
    """Weights left unpacked (the torch GEMM path) give no stack; the steps run as before."""
    with use_kernel_config(gemm="torch"):
        model_config, model = _build(tmp_path, TINY["llama-gqa"], "float32")
        _step_logits(model, model_config)
    assert model.model._stack is None


def test_layer_stack_int8_products_on_amx(tmp_path, monkeypatch):
    """Without batch invariance, from ``int8_amx_min_rows`` rows on, int8-tiled products run on AMX
    over bfloat16-decoded panels; the loop takes the same threshold, so its logits still equal the
    Python layers' bit for bit. The threshold is lowered to 4 so that this batch's decode steps take
    that path."""
    if int8_tiling_reason(torch.device("cpu")) is not None:
        pytest.skip(int8_tiling_reason(torch.device("cpu")))
    path = write_tiny_llama_gguf(str(tmp_path / "model.gguf"), "Q4_1", 211)
    model_config = load_model_config(path, dtype="float32")
    model_config.int8_activations = True
    if not cpu_kernels().decoded_gemm_supported(model_config.hf_config.hidden_size):
        pytest.skip("no AMX here")
    model = build_model(model_config, "cpu")
    on_dot_products = _step_logits(model, model_config)
    runs = _count_stack_runs(monkeypatch)
    with use_kernel_config(int8_amx_min_rows=4, batch_invariant=False):  # invariance keeps int8 at any rows
        with_stack = _step_logits(model, model_config)
        assert runs.count([DECODE_KERNEL]) == 4
        assert not torch.equal(with_stack[1], on_dot_products[1])  # a decode step took the other path
        without = _without_stack(model, model_config)
    for a, b in zip(with_stack, without, strict=True):
        assert torch.equal(a, b)
