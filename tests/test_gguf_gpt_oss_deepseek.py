"""GPT-OSS ("gpt-oss") and DeepSeek-V3 ("deepseek2") from GGUF files written as llama.cpp's converter
writes them (tests/gguf_families.py), on the models their Hugging Face folders load into.

GPT-OSS: sinks as ``attn_sinks.weight``, sliding and full layers alternating, yarn rope, experts split
into gate / up / down stacks with their biases; with the experts in MXFP4 (llama.cpp's MXFP4_MOE) they
stay packed and equal transformers running the same weights dequantized. DeepSeek-V3: the latent
attention's sizes under llama.cpp's MLA keys, kv_b_proj split per head into ``attn_k_b`` and
``attn_v_b`` (joined back at load), sigmoid routing over groups with ``exp_probs_b``, leading dense
layers, a shared expert; the low-rank and the direct query. F32 files equal the model they came
from, logits and greedy tokens. DeepSeek-V2-style routing (softmax gating) and unknown architectures
are refused by name.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leaks, train_tokenizer
from gguf_families import dequantized_copy, write_family_gguf
from requirements_here import require
from test_deepseek_v3 import random_deepseek
from test_gguf_families import _logits
from test_gpt_oss import WINDOW, random_gpt_oss
from test_model_families import VOCAB, hf_prompt_and_step
from test_moe_families import engine_greedy, hf_greedy_of, prompts_for

from pagedllm import LLM
from pagedllm.models import build_model, load_model_config
from pagedllm.models.gguf_loader import iter_gguf_weights, read_gguf
from pagedllm.quantization.formats import MXFP4
from pagedllm.quantization.packed import PackedTensor, QuantizedWeight

transformers = require("transformers")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


def assert_logits_equal(model, model_config, hf_model, seed: int) -> None:
    """Prefills of 1 to 21 tokens, then a decode step each, against transformers."""
    prompts = prompts_for(seed)
    next_tokens = [5, 17, 101, 42]
    prefill, decode = _logits(model, model_config, prompts, next_tokens)
    for i, (prompt, token) in enumerate(zip(prompts, next_tokens)):
        ref_prefill, ref_step = hf_prompt_and_step(hf_model, prompt, token)
        torch.testing.assert_close(prefill[i], ref_prefill, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(decode[i], ref_step, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- GPT-OSS


def test_gpt_oss_gguf_equals_transformers(tokenizer, tmp_path) -> None:
    hf_model = random_gpt_oss()
    path = write_family_gguf(hf_model, tokenizer, "gpt-oss", str(tmp_path / "gpt-oss.gguf"))
    model_config = load_model_config(path)
    config = model_config.hf_config
    assert config.model_type == "gpt_oss" and config.layer_types == ["sliding_attention", "full_attention"]
    assert config.swiglu_limit == hf_model.config.swiglu_limit and config.rope_parameters["rope_type"] == "yarn"
    model = build_model(model_config, "cpu")
    layers = model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [WINDOW, None]
    torch.testing.assert_close(layers[1].self_attn.attn.sinks, hf_model.model.layers[1].self_attn.sinks)
    torch.testing.assert_close(layers[0].mlp.experts[3].down_proj.bias,
                               hf_model.model.layers[0].mlp.experts.down_proj_bias[3])
    assert_logits_equal(model, model_config, hf_model, seed=4)

    llm = LLM(path, block_size=4, num_kv_blocks=64)
    prompts = prompts_for(5)
    assert engine_greedy(llm, prompts) == hf_greedy_of(hf_model, prompts, 16)
    assert_no_leaks(llm)


def test_gpt_oss_gguf_mxfp4_experts_stay_packed(tokenizer, tmp_path) -> None:
    """llama.cpp's MXFP4_MOE: the expert stacks in MXFP4 (every expert's rows cut out of the stack as
    packed bytes, no float copy), everything else F32; greedy equal to transformers on the same
    weights dequantized by gguf-py."""
    hf_model = random_gpt_oss()
    path = write_family_gguf(hf_model, tokenizer, "gpt-oss", str(tmp_path / "gpt-oss-mxfp4.gguf"),
                             weight_type="MXFP4")
    assert {info.ggml_type for name, info in read_gguf(path).tensors.items() if "_exps.weight" in name} == {39}
    experts = {name: w for name, w in iter_gguf_weights(read_gguf(path)) if ".experts." in name}
    assert len(experts) == 2 * 4 * 3 * 2  # layers x experts x (gate, up, down) x (weight, bias)
    for name, weight in experts.items():
        if name.endswith(".bias"):
            assert isinstance(weight, torch.Tensor) and weight.shape == ((64,) if ".down_proj." in name else (32,))
            continue
        cols = 32 if ".down_proj." in name else 64
        assert isinstance(weight, PackedTensor) and weight.fmt == MXFP4 and weight.shape[1] == cols, name
        assert weight.data.untyped_storage().nbytes() == weight.shape[0] * MXFP4.row_bytes(cols)

    llm = LLM(path, block_size=4, num_kv_blocks=64, int8_activations=False)
    for layer in llm.llm_engine.worker.runner.model.model.layers:
        for expert in layer.mlp.experts:
            for linear in (expert.gate_up_proj, expert.down_proj):
                assert isinstance(linear.weight, QuantizedWeight) and linear.weight.formats == ["MXFP4"]
    reference = dequantized_copy(hf_model, "MXFP4")
    prompts = prompts_for(6)
    assert engine_greedy(llm, prompts) == hf_greedy_of(reference, prompts, 16)
    assert_no_leaks(llm)


# ---------------------------------------------------------------- DeepSeek-V3


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}


@pytest.mark.parametrize("variant", ["q-lora", "q-proj-yarn"])
def test_deepseek_v3_gguf_equals_transformers(variant: str, tokenizer, tmp_path) -> None:
    from pagedllm.models.deepseek_moe import DeepseekMLP, DeepseekMoE

    overrides = {} if variant == "q-lora" else {"q_lora_rank": None, "rope_parameters": YARN}
    hf_model = random_deepseek(**overrides)
    path = write_family_gguf(hf_model, tokenizer, "deepseek2", str(tmp_path / f"deepseek-{variant}.gguf"))
    names = read_gguf(path).tensors
    assert "blk.1.attn_k_b.weight" in names and "blk.1.attn_kv_b.weight" not in names
    model_config = load_model_config(path)
    config, expected = model_config.hf_config, hf_model.config
    assert config.model_type == "deepseek_v3"
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
                "topk_group", "n_shared_experts", "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob",
                "rope_interleave"):
        assert getattr(config, key) == getattr(expected, key), key
    model = build_model(model_config, "cpu")
    assert [type(layer.mlp) for layer in model.model.layers] == [DeepseekMLP, DeepseekMoE, DeepseekMoE]
    attn = model.model.layers[2].self_attn
    torch.testing.assert_close(attn.kv_b_proj.weight, hf_model.model.layers[2].self_attn.kv_b_proj.weight)
    assert attn.attn.scale == pytest.approx(hf_model.model.layers[2].self_attn.scaling)
    assert_logits_equal(model, model_config, hf_model, seed=7)

    llm = LLM(path, block_size=4, num_kv_blocks=64)
    prompts = prompts_for(8)
    assert engine_greedy(llm, prompts) == hf_greedy_of(hf_model, prompts, 16)
    assert_no_leaks(llm)


def test_deepseek_v3_gguf_q8_experts_stay_packed(tokenizer, tmp_path) -> None:
    """Q8_0 matrices: the experts and projections stay packed; k_b / v_b (3-D, quantized along their own
    rows) are dequantized into kv_b_proj, which attention reads per head. The packed model computes
    what the same file dequantized computes."""
    hf_model = random_deepseek()
    path = write_family_gguf(hf_model, tokenizer, "deepseek2", str(tmp_path / "deepseek-q8.gguf"), weight_type="Q8_0")
    packed_config = load_model_config(path)
    packed_config.int8_activations = False  # float activations: the dequantized model's results
    packed = build_model(packed_config, "cpu")
    moe = packed.model.layers[1].mlp
    assert all(isinstance(linear.weight, QuantizedWeight) and linear.weight.formats == ["Q8_0"]
               for expert in [*moe.experts, moe.shared_experts] for linear in (expert.gate_up_proj, expert.down_proj))
    reference = build_model(load_model_config(path, quantization="dequantize"), "cpu")
    prompts, next_tokens = prompts_for(9), [5, 17, 101, 42]
    got = _logits(packed, packed_config, prompts, next_tokens)
    expected = _logits(reference, packed_config, prompts, next_tokens)
    torch.testing.assert_close(torch.cat(got[0]), torch.cat(expected[0]), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got[1], expected[1], atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------- refused


def _metadata_only_gguf(path: str, arch: str, **keys) -> str:
    """A GGUF file of ``arch`` holding a few metadata keys and no tensors: enough to be refused."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_vocab_size(VOCAB)
    for key, value in keys.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_deepseek_v2_softmax_routing_is_refused(tmp_path) -> None:
    """llama.cpp writes DeepSeek-V2 / V2-Lite as deepseek2 too, with softmax gating (or none written)."""
    for gating in ({}, {"expert_gating_func": 1}):
        path = _metadata_only_gguf(str(tmp_path / "v2.gguf"), "deepseek2", expert_count=8, expert_used_count=2,
                                   **gating)
        with pytest.raises(ValueError, match="DeepSeek-V2 style model .* sigmoid routing only"):
            load_model_config(path)


def test_unsupported_architecture_is_refused(tmp_path) -> None:
    path = _metadata_only_gguf(str(tmp_path / "mamba.gguf"), "mamba")
    with pytest.raises(ValueError, match=r"architecture 'mamba'; pagedllm loads GGUF models of architecture .*"
                                         r"gpt-oss, deepseek2 only"):
        load_model_config(path)
