"""Mixtures of experts against transformers, through the paged KV cache and the engine.

Qwen2-MoE from a Hugging Face folder: routed experts (softmax top-k, not renormalized), a shared
expert scaled by ``sigmoid(shared_expert_gate(x))``, and sparse and dense layers mixed
(``mlp_only_layers``), alone and under tensor parallelism. Mixtral (llama.cpp's "llama" with
experts), Qwen3-MoE and Qwen2-MoE from GGUF files written as llama.cpp's converter writes them,
experts stacked in 3-D tensors: in F32 they equal the model they came from; with quantized experts
those stay packed (each expert a 2-D slice of the stack, no float copy) and equal transformers
running the same weights dequantized.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leaks, train_tokenizer
from gguf_families import dequantized_copy, write_family_gguf
from oracle import assert_not_degenerate
from requirements_here import require
from test_gguf_families import _logits
from test_model_families import VOCAB, hf_prompt_and_step, random_hf_model

from pagedllm import LLM, SamplingParams
from pagedllm.attention import PagedAttention
from pagedllm.models import build_model, load_model_config
from pagedllm.models.gguf_loader import iter_gguf_weights, read_gguf
from pagedllm.models.moe import GatedMLP, SparseMoE
from pagedllm.quantization.formats import GGUF_PACKED_TYPES
from pagedllm.quantization.packed import PackedTensor, QuantizedWeight

transformers = require("transformers")

PROMPT_LENS = (1, 6, 13, 21)
NEW_TOKENS = 16


def moe_config(name: str, **overrides):
    """A tiny model of the family: 4 experts, 2 per token, experts 32 wide (a Q4_0 / Q8_0 block)."""
    t = transformers
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, bos_token_id=1,
                  eos_token_id=2, pad_token_id=3)
    common.update(overrides)
    if name == "qwen2_moe":
        return t.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=64, **common)
    if name == "qwen3_moe":  # llama.cpp always renormalizes Qwen3-MoE's chosen weights
        return t.Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True, **common)
    if name == "mixtral":
        return t.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **{**common, "intermediate_size": 32})
    raise ValueError(name)


def hf_greedy_of(hf_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (EOS an ordinary token), not degenerate."""
    hf_model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=3)
            outputs.append(out[0, len(ids):].tolist())
    assert_not_degenerate(outputs)
    return outputs


def engine_greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def prompts_for(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def assert_logits_match(model, model_config, hf_model, prompts: list[list[int]]) -> None:
    """A prefill of every prompt, then one decode step, against transformers with its KV cache;
    through the C++ decode kernel and the torch path."""
    next_tokens = [5, 17, 101, 42][:len(prompts)]
    expected = [hf_prompt_and_step(hf_model, p, t) for p, t in zip(prompts, next_tokens)]
    for use_kernel in (True, False):
        for module in model.modules():
            if isinstance(module, PagedAttention):
                module.use_cpu_kernel = use_kernel
        prefill, decode = _logits(model, model_config, prompts, next_tokens)
        for i, (ref_prefill, ref_step) in enumerate(expected):
            torch.testing.assert_close(prefill[i], ref_prefill, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(decode[i], ref_step, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- Qwen2-MoE from a Hugging Face folder


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory) -> str:
    """Three layers: sparse, dense (``mlp_only_layers``), sparse."""
    folder = str(tmp_path_factory.mktemp("qwen2_moe"))
    train_tokenizer(folder)
    random_hf_model(moe_config("qwen2_moe", num_hidden_layers=3, mlp_only_layers=[1])).save_pretrained(folder)
    return folder


def test_qwen2_moe_matches_transformers(qwen2_moe_dir: str) -> None:
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(qwen2_moe_dir, dtype=torch.float32).eval()
    model_config = load_model_config(qwen2_moe_dir, dtype="float32")
    model = build_model(model_config, "cpu")
    # The table reaches the layers: the dense layer in the middle, the shared expert and its gate, no
    # renormalization (Qwen2-MoE's default), q/k/v biases.
    mlps = [layer.mlp for layer in model.model.layers]
    assert [type(m) for m in mlps] == [SparseMoE, GatedMLP, SparseMoE]
    assert all(isinstance(m.shared_expert, GatedMLP) and m.shared_expert_gate.weight.shape == (1, 64)
               for m in (mlps[0], mlps[2]))
    assert not mlps[0].normalize and model.model.layers[0].self_attn.qkv_proj.bias is not None
    assert_logits_match(model, model_config, hf_model, prompts_for(1))

    llm = LLM(qwen2_moe_dir, dtype="float32", block_size=4, num_kv_blocks=64)
    prompts = prompts_for(2)
    assert engine_greedy(llm, prompts) == hf_greedy_of(hf_model, prompts, NEW_TOKENS)
    assert_no_leaks(llm)


def test_qwen2_moe_tensor_parallel_greedy(qwen2_moe_dir: str) -> None:
    """Two ranks: each expert and the shared one split like an MLP, the router and the shared
    expert's gate whole on both, one all-reduce for the layer."""
    from test_tensor_parallel import _children_alive, _engine_kwargs

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(qwen2_moe_dir, dtype=torch.float32).eval()
    prompts = prompts_for(3)
    tp2 = LLM(qwen2_moe_dir, tensor_parallel_size=2, **_engine_kwargs(num_kv_blocks=96))
    try:
        assert engine_greedy(tp2, prompts) == hf_greedy_of(hf_model, prompts, NEW_TOKENS)
        assert_no_leaks(tp2)
    finally:
        tp2.llm_engine.shutdown()
    assert not _children_alive()


# ---------------------------------------------------------------- GGUF files with experts

# llama.cpp architecture -> the transformers family written under it.
GGUF_MOE = {"llama": "mixtral", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


def expert_layers(model) -> list:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE)]


@pytest.mark.parametrize("arch", list(GGUF_MOE))
def test_gguf_moe_equals_transformers(arch: str, tokenizer, tmp_path) -> None:
    """F32 experts: the file's config and weights make the model it was written from."""
    hf_model = random_hf_model(moe_config(GGUF_MOE[arch]))
    path = write_family_gguf(hf_model, tokenizer, arch, str(tmp_path / f"{arch}.gguf"))
    model_config = load_model_config(path)
    assert model_config.hf_config.model_type == hf_model.config.model_type
    model = build_model(model_config, "cpu")
    assert len(expert_layers(model)) == 2
    assert_logits_match(model, model_config, hf_model, prompts_for(4))

    llm = LLM(path, block_size=4, num_kv_blocks=64)
    prompts = prompts_for(5)
    assert engine_greedy(llm, prompts) == hf_greedy_of(hf_model, prompts, NEW_TOKENS)
    assert_no_leaks(llm)


@pytest.mark.parametrize(("arch", "weight_type"), [("llama", "Q8_0"), ("qwen2moe", "Q4_0"), ("qwen3moe", "Q4_0")])
def test_gguf_quantized_experts_stay_packed(arch: str, weight_type: str, tokenizer, tmp_path) -> None:
    hf_model = random_hf_model(moe_config(GGUF_MOE[arch]))
    path = write_family_gguf(hf_model, tokenizer, arch, str(tmp_path / f"{arch}-{weight_type}.gguf"),
                             weight_type=weight_type)
    fmt = GGUF_PACKED_TYPES[weight_type]

    # The loader cuts each expert's bytes out of the stack: a packed 2-D tensor holding that expert only.
    experts = {name: w for name, w in iter_gguf_weights(read_gguf(path)) if ".experts." in name}
    assert len(experts) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    for name, weight in experts.items():
        cols = 32 if ".down_proj." in name else 64  # experts 32 wide, hidden 64
        assert isinstance(weight, PackedTensor) and weight.fmt == fmt and weight.shape[1] == cols, name
        assert weight.data.untyped_storage().nbytes() == weight.nbytes == weight.shape[0] * fmt.row_bytes(cols)

    llm = LLM(path, block_size=4, num_kv_blocks=64, int8_activations=False)
    # Every expert's layers hold the packed rows and nothing else (no float copy beside them).
    for moe in expert_layers(llm.llm_engine.worker.runner.model):
        for expert in [*moe.experts, *([moe.shared_expert] if moe.shared_expert is not None else [])]:
            for linear in (expert.gate_up_proj, expert.down_proj):
                weight = linear.weight
                assert isinstance(weight, QuantizedWeight) and weight.formats == [weight_type]
                assert weight.nbytes == weight.shape[0] * fmt.row_bytes(weight.shape[1])
                assert linear.packed_weight is None and not any(True for _ in linear.parameters(recurse=False))

    reference = dequantized_copy(hf_model, weight_type)
    prompts = prompts_for(6)
    assert engine_greedy(llm, prompts) == hf_greedy_of(reference, prompts, NEW_TOKENS)
    assert_no_leaks(llm)
