"""GGUF round trip per architecture: a tiny transformers model written as llama.cpp writes it,
loaded back (config, tokenizer and weights from the file) equals the model it came from; with
quantized weights the packed path equals the same file dequantized."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leaks, train_tokenizer
from gguf_families import write_family_gguf
from oracle import assert_not_degenerate
from requirements_here import require
from test_model_families import VOCAB, WINDOW, hf_prompt_and_step, random_hf_model
from test_models import PagedBatch, make_caches

from pagedllm import LLM, SamplingParams
from pagedllm.models import build_model, load_model_config, load_tokenizer
from pagedllm.quantization.packed import QuantizedWeight

transformers = require("transformers")


def gguf_config(arch: str):
    t = transformers
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, bos_token_id=1,
                  eos_token_id=2, pad_token_id=3)
    if arch == "qwen2":
        return t.Qwen2Config(**common)
    if arch == "qwen3":
        return t.Qwen3Config(head_dim=16, tie_word_embeddings=True, **common)
    if arch == "gemma2":
        return t.Gemma2Config(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **common)
    if arch == "gemma3":  # six layers: llama.cpp's pattern of five local layers, then a global one
        return t.Gemma3TextConfig(
            head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
            **{**common, "num_hidden_layers": 6})
    if arch == "phi3":
        return t.Phi3Config(
            sliding_window=WINDOW, original_max_position_embeddings=16,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0],
                             "original_max_position_embeddings": 16},
            **common)
    if arch == "gptneox":
        return t.GPTNeoXConfig(use_parallel_residual=True,
                               **{k: v for k, v in common.items() if k != "num_key_value_heads"})
    raise ValueError(arch)


ARCHS = ["qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gptneox"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


def _hf_model(arch: str):
    hf_model = random_hf_model(gguf_config(arch))
    if arch == "gemma2":
        # llama.cpp's Gemma 2 always ties its head to the embedding, which Gemma scales by sqrt(hidden): at
        # full size it drowns these tiny random layers, each token maps back to itself and greedy repeats one
        # token (a degenerate oracle, oracle.py). A tenth of it lets the layers steer.
        with torch.no_grad():
            hf_model.model.embed_tokens.weight.mul_(0.1)
    return hf_model


def _logits(model, model_config, prompts, next_tokens):
    caches = make_caches(model_config)
    batch = PagedBatch(len(prompts))
    with torch.inference_mode():
        positions, meta = batch.step([len(p) for p in prompts])
        prefill = model.compute_logits(model(torch.tensor([t for p in prompts for t in p]), positions, caches, meta))
        positions, meta = batch.step([1] * len(prompts))
        decode = model.compute_logits(model(torch.tensor(next_tokens), positions, caches, meta))
    return prefill.split([len(p) for p in prompts]), decode


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_round_trip(arch: str, tokenizer, tmp_path) -> None:
    hf_model = _hf_model(arch)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in (1, 9, 19)]
    next_tokens = [7, 70, 170]

    path = write_family_gguf(hf_model, tokenizer, arch, str(tmp_path / f"{arch}-f32.gguf"))
    model_config = load_model_config(path)
    assert model_config.hf_config.model_type == hf_model.config.model_type
    model = build_model(model_config, "cpu")
    prefill, decode = _logits(model, model_config, prompts, next_tokens)
    for i, (prompt, token) in enumerate(zip(prompts, next_tokens)):
        ref_prefill, ref_step = hf_prompt_and_step(hf_model, prompt, token)
        torch.testing.assert_close(prefill[i], ref_prefill, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(decode[i], ref_step, atol=1e-4, rtol=1e-4)
    text = "The quick brown fox: PagedAttention blocks!"
    assert load_tokenizer(model_config).encode(text) == tokenizer.encode(text)

    # Quantized linears stay packed, and compute what the same file dequantized computes.
    path = write_family_gguf(hf_model, tokenizer, arch, str(tmp_path / f"{arch}-q8.gguf"), weight_type="Q8_0")
    packed_config = load_model_config(path)
    packed_config.int8_activations = False  # float activations: the dequantized model's results
    packed = build_model(packed_config, "cpu")
    assert sum(isinstance(getattr(m, "weight", None), QuantizedWeight) for m in packed.modules()) >= 5
    reference = build_model(load_model_config(path, quantization="dequantize"), "cpu")
    got, expected = _logits(packed, packed_config, prompts, next_tokens), _logits(reference, packed_config, prompts,
                                                                                 next_tokens)
    torch.testing.assert_close(torch.cat(got[0]), torch.cat(expected[0]), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got[1], expected[1], atol=2e-3, rtol=2e-3)


def test_gguf_engine_greedy_past_the_window(tokenizer, tmp_path) -> None:
    """Gemma 2 from a GGUF file through the engine: text in, greedy tokens equal to transformers."""
    hf_model = _hf_model("gemma2")
    path = write_family_gguf(hf_model, tokenizer, "gemma2", str(tmp_path / "gemma2.gguf"))
    llm = LLM(path, block_size=4, num_kv_blocks=64)
    prompt = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(prompt)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    hf_model.generation_config.eos_token_id = None
    with torch.inference_mode():
        ref = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=16, do_sample=False, pad_token_id=3)
    assert_not_degenerate(ref[0, len(ids):].tolist())
    assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
    assert_no_leaks(llm)
