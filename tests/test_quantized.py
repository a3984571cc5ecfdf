"""Packed quantized weights: formats against gguf-py, kernels against the dequantized product, GGUF
models of every packed type and load-time int8 / int4 against the same weights dequantized."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import assert_no_leaks, train_tokenizer
from gguf_models import Q4_K_M, random_kquant, write_tiny_llama_gguf

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import use_kernel_config
from pagedllm.layers.cpu_gemm import PackableLinear
from pagedllm.models.loader import build_model, load_model_config
from pagedllm.quantization import formats
from pagedllm.quantization.apply import packed_weight_bytes
from pagedllm.quantization.kernels import SMALL_M, packed_embedding, packed_linear
from pagedllm.quantization.packed import PackedTensor, QuantizedWeight
from pagedllm.quantization.quantize import make_quantizer, quantize_int4_groups, quantize_int8_per_channel

GGUF_TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
# The formats the C++ kernels multiply: the GGUF linears' types and MXFP4 (GPT-OSS's experts).
KERNEL_TYPES = [*GGUF_TYPES, "MXFP4"]
NEW_TOKENS = 16


def _packed(type_name: str, rows: int, cols: int, seed: int = 0) -> PackedTensor:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    fmt = formats.MXFP4 if type_name == "MXFP4" else formats.GGUF_PACKED_TYPES[type_name]
    if type_name in ("Q4_K", "Q5_K", "Q6_K"):
        data = random_kquant(rng, type_name, rows, cols)
    else:
        data = quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), GGMLQuantizationType[type_name])
    return PackedTensor(torch.from_numpy(np.ascontiguousarray(data)), fmt, cols)


# ------------------------------------------------------------------------------------ formats


@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_dequantize_equals_gguf_py(type_name, kernel_level):
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    packed = _packed(type_name, 24, 512)
    expected = torch.from_numpy(dequantize(packed.data.numpy(), GGMLQuantizationType[type_name]).astype(np.float32))
    torch.testing.assert_close(formats.dequantize(packed.data, packed.fmt, 512), expected, rtol=0, atol=0)
    cpp = kernel_level.module.dequantize_rows(packed.data, packed.fmt.id, 512, None)
    torch.testing.assert_close(cpp, expected, rtol=1e-6, atol=1e-7)  # an FMA may round once less


@pytest.mark.parametrize("type_name", KERNEL_TYPES)
@pytest.mark.parametrize("rows", [1, 3, SMALL_M + 5])
def test_packed_linear_equals_dequantized_product(type_name, rows, kernel_level):
    packed = _packed(type_name, 37, 512, seed=rows)  # 37 output rows: a partial tile of 4
    weight = packed.dequantize()
    x = torch.randn(rows, 512)
    bias = torch.randn(37)
    expected = torch.nn.functional.linear(x, weight, bias)
    got = packed_linear(x, packed.data, packed.fmt, 512, bias)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
    kernel_level.assert_ran("quant_linear")


def test_torch_reference_path_matches_kernel():
    packed = _packed("Q4_K", 16, 256)
    x = torch.randn(2, 256)
    kernel = packed_linear(x, packed.data, packed.fmt, 256, None)
    with use_kernel_config(quant_kernel="torch"):
        reference = packed_linear(x, packed.data, packed.fmt, 256, None)
        torch.testing.assert_close(kernel, reference, rtol=1e-4, atol=1e-5)
        ids = torch.tensor([[3, 0], [15, 3]])
        torch.testing.assert_close(packed_embedding(ids, packed.data, packed.fmt, 256), packed.dequantize()[ids])


def test_packed_tensor_narrows_on_block_boundaries_only():
    packed = _packed("Q4_0", 8, 256)
    full = packed.dequantize()
    torch.testing.assert_close(packed.narrow(1, 64, 128).dequantize(), full[:, 64:192], rtol=0, atol=0)
    torch.testing.assert_close(packed.narrow(0, 2, 3).dequantize(), full[2:5], rtol=0, atol=0)
    top, bottom = packed.split([5, 3])
    torch.testing.assert_close(bottom.dequantize(), full[5:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="32-value blocks"):
        packed.narrow(1, 16, 64)
    with pytest.raises(ValueError, match="256-value blocks"):
        _packed("Q6_K", 4, 512).narrow(1, 128, 256)


def test_quantized_weight_keeps_formats_per_segment_and_merges():
    a, b, c = _packed("Q4_K", 8, 256), _packed("Q6_K", 4, 256), _packed("Q4_K", 4, 256, seed=3)
    weight = QuantizedWeight(16, 256, torch.float32)
    weight.data[0:8].assign("q", a)
    weight.data[12:16].assign("v", c)
    with pytest.raises(ValueError, match="never loaded"):
        weight.finish("qkv")
    weight.data[8:12].assign("k", b)
    weight.finish("qkv")
    assert weight.formats == ["Q4_K", "Q6_K", "Q4_K"]
    x = torch.randn(3, 256)
    dense = torch.cat([a.dequantize(), b.dequantize(), c.dequantize()])
    torch.testing.assert_close(weight.linear(x, None), x @ dense.T, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight.embedding(torch.tensor([0, 9, 15])), dense[[0, 9, 15]])
    with pytest.raises(ValueError, match="model expects"):
        weight.data[0:8].assign("q", _packed("Q4_K", 8, 512))


@pytest.mark.parametrize("method", ["int8", "int4-32", "int4-64", "int4-128"])
def test_load_time_quantizers(method):
    torch.manual_seed(0)
    w = torch.randn(48, 256) * 0.05
    packed = quantize_int8_per_channel(w) if method == "int8" else quantize_int4_groups(w, int(method.split("-")[1]))
    approx = packed.dequantize()
    scale = w.abs().amax() / (127 if method == "int8" else 7)
    assert float((approx - w).abs().max()) <= float(scale)
    assert packed.data.numel() <= w.numel() * (1.02 if method == "int8" else 0.63)
    x = torch.randn(5, 256)
    torch.testing.assert_close(packed_linear(x, packed.data, packed.fmt, 256, None), x @ approx.T, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(packed.narrow(1, 128, 128).dequantize(), approx[:, 128:], rtol=0, atol=0)


# ------------------------------------------------------------------------------ GGUF models


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    train_tokenizer(path)
    return path


def _vocab(tokenizer_dir: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(tokenizer_dir))


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def _gguf(gguf_dir, tokenizer_dir, name: str, types, **kwargs) -> str:
    path = os.path.join(gguf_dir, f"{name}.gguf")
    if not os.path.exists(path):
        write_tiny_llama_gguf(path, types, _vocab(tokenizer_dir), **kwargs)
    return path


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(4, vocab, size=n).tolist() for n in (1, 5, 17, 40)]


def _dequantized_engine(path: str, tokenizer_dir: str) -> LLM:
    """The same GGUF with every tensor dequantized to float32 at load time."""
    return LLM(path, tokenizer=tokenizer_dir, quantization="dequantize", num_kv_blocks=64, block_size=8)


@pytest.mark.parametrize("types", GGUF_TYPES + ["Q4_K_M"])
def test_gguf_packed_greedy_equals_dequantized(types, gguf_dir, tokenizer_dir, kernel_level):
    path = _gguf(gguf_dir, tokenizer_dir, types, Q4_K_M if types == "Q4_K_M" else types, tied=types == "Q4_1")
    packed = LLM(path, tokenizer=tokenizer_dir, num_kv_blocks=64, block_size=8, int8_activations=False)
    model = packed.llm_engine.worker.runner.model
    packed_bytes, found = packed_weight_bytes(model)
    expected_formats = {"Q4_K", "Q6_K"} if types == "Q4_K_M" else {types}
    assert set(found) == expected_formats
    # Resident weights are the file's blocks: no float copy of any linear or embedding.
    assert not any(isinstance(m, PackableLinear) and isinstance(m.weight, torch.Tensor) for m in model.modules())
    assert packed_bytes <= os.path.getsize(path)
    reference = _dequantized_engine(path, tokenizer_dir)
    assert packed_weight_bytes(reference.llm_engine.worker.runner.model)[0] == 0
    prompts = _prompts(_vocab(tokenizer_dir))
    assert _greedy(packed, prompts) == _greedy(reference, prompts)
    assert_no_leaks(packed)
    assert_no_leaks(reference)
    kernel_level.assert_ran("quant_linear", "paged_decode_attention", "greedy_pick")


def test_gguf_type_not_kept_packed_is_dequantized_with_a_warning(gguf_dir, tokenizer_dir, caplog):
    path = _gguf(gguf_dir, tokenizer_dir, "q5_0", {"default": "Q4_0", "ffn_up": "Q5_0"})
    with caplog.at_level("WARNING"):
        llm = LLM(path, tokenizer=tokenizer_dir, num_kv_blocks=32, block_size=8, int8_activations=False)
    assert any("Q5_0" in r.message and "ffn_up" in r.message for r in caplog.records)
    model = llm.llm_engine.worker.runner.model
    # Per layer qkv, o, down and the gate half of gate_up stay Q4_0; the up half is float; + embedding, output.
    assert packed_weight_bytes(model)[1] == {"Q4_0": 2 * 4 + 2, "float32": 2}
    assert len(_greedy(llm, _prompts(_vocab(tokenizer_dir)))[0]) == NEW_TOKENS


def test_gguf_refuses_load_time_quantization(gguf_dir, tokenizer_dir):
    path = _gguf(gguf_dir, tokenizer_dir, "Q4_0", "Q4_0")
    with pytest.raises(ValueError, match="keeps its own quantized types"):
        load_model_config(path, quantization="int8")
    with pytest.raises(ValueError, match="quantization must be"):
        load_model_config(path, quantization="int3")



def test_tensor_parallel_shards_of_packed_weights(gguf_dir, tokenizer_dir):
    """2 ranks: each holds half of every split packed weight, cut on block boundaries; same greedy output."""
    path = _gguf(gguf_dir, tokenizer_dir, "Q8_0", "Q8_0")
    single = LLM(path, tokenizer=tokenizer_dir, num_kv_blocks=64, block_size=8, int8_activations=False)
    split = LLM(path, tokenizer=tokenizer_dir, num_kv_blocks=64, block_size=8, tensor_parallel_size=2,
                int8_activations=False)
    try:
        prompts = _prompts(_vocab(tokenizer_dir))
        assert _greedy(split, prompts) == _greedy(single, prompts)
        assert_no_leaks(split)
    finally:
        split.llm_engine.shutdown()


def test_tensor_parallel_refuses_a_split_inside_a_block(gguf_dir, tokenizer_dir):
    from pagedllm.layers.parallel_state import override_tp_state

    path = _gguf(gguf_dir, tokenizer_dir, "Q6_K", "Q6_K")  # 256-value blocks; o_proj's 256 inputs / 2 ranks
    config = load_model_config(path)
    with override_tp_state(0, 2), pytest.raises(ValueError, match="256-value blocks"):
        build_model(config)


# ----------------------------------------------------------------- load-time quantization (HF)


def _dequantized_reference(folder: str, method: str, group_size: int) -> LLM:
    """A float engine whose decoder linears hold exactly the values the quantizer stores."""
    with use_kernel_config(gemm="torch"):  # plain float parameters to overwrite
        llm = LLM(folder, dtype="float32", num_kv_blocks=64, block_size=8)
    quantizer = make_quantizer(method, group_size)
    with torch.no_grad():
        for module in llm.llm_engine.worker.runner.model.modules():
            if isinstance(module, PackableLinear):
                module.weight.copy_(quantizer(module.weight).dequantize())
    return llm


@pytest.mark.parametrize("quantization", ["int8", "int4", "int4-g32", "int4-g64"])
def test_hf_load_time_quantization_equals_dequantized(tiny_model_factory, quantization):
    folder = tiny_model_factory("llama")
    with pytest.raises(ValueError, match="needs a .gguf model"):
        load_model_config(folder, quantization="dequantize")
    llm = LLM(folder, dtype="float32", quantization=quantization, num_kv_blocks=64, block_size=8,
              int8_activations=False)
    model = llm.llm_engine.worker.runner.model
    packed_bytes, found = packed_weight_bytes(model)
    # hidden 64, intermediate 128: groups of 128 fit only down_proj; the others take 64.
    expected = {"int8": {"I8_ROW"}, "int4": {"I4_G64", "I4_G128"}, "int4-g32": {"Q4_1"}, "int4-g64": {"I4_G64"}}
    assert set(found) == expected[quantization]
    float_bytes = sum(m.weight.shape.numel() * 4 for m in model.modules() if isinstance(m, PackableLinear))
    assert packed_bytes < float_bytes * (0.27 if quantization == "int8" else 0.16)
    method, _, group = quantization.partition("-g")
    reference = _dequantized_reference(folder, method, int(group or 128))
    vocab = model.config.vocab_size
    assert _greedy(llm, _prompts(vocab)) == _greedy(reference, _prompts(vocab))
    assert_no_leaks(llm)
