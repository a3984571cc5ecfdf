"""OLMo 2 and 3, Granite 3, StableLM, Phi-2, Cohere (Command-R) and Cohere 2 against transformers
on tiny random models, through the paged KV cache; and the same models written as llama.cpp writes
them to GGUF.

Each family is the one decoder configured by its Family entry (post-norms, multipliers, one shared
input norm, per-head or whole-projection q/k norms, interleaved rope, layers without rope); these
tests are what holds each setting to transformers' definition.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leaks, train_tokenizer
from gguf_families import write_family_gguf
from oracle import assert_engine_greedy_equals_transformers, hf_greedy
from requirements_here import require
from test_gguf_families import _logits
from test_model_families import PROMPT_LENS, VOCAB, WINDOW, hf_prompt_and_step, random_hf_model

from pagedllm import LLM, SamplingParams
from pagedllm.attention import PagedAttention
from pagedllm.kernels.codes import PARALLEL_SHARED, POST_NORM
from pagedllm.models import build_model, load_model_config
from pagedllm.models.layer_stack import model_programs
from pagedllm.quantization.packed import QuantizedWeight

transformers = require("transformers")

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, bos_token_id=1,
              eos_token_id=2, pad_token_id=3)
# Multipliers of Granite 3's kind (its 8B model: 12, 0.22, 1/128, 16); the attention scale 1/64 is
# not head_dim ** -0.5 = 1/4, so a decoder ignoring it fails.
GRANITE = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1 / 64, logits_scaling=8.0)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


def family_config(name: str):
    t = transformers
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    configs = {
        "olmo2": lambda: t.Olmo2Config(**COMMON),
        "olmo3": lambda: t.Olmo3Config(
            sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": rope, "full_attention": {**rope, "rope_theta": 500000.0}},
            **COMMON),
        "granite": lambda: t.GraniteConfig(attention_bias=True, **GRANITE, **COMMON),
        "stablelm": lambda: t.StableLmConfig(
            qk_layernorm=True, use_qkv_bias=True, use_parallel_residual=False,
            rope_parameters={**rope, "partial_rotary_factor": 0.25}, **COMMON),
        "stablelm-parallel": lambda: t.StableLmConfig(
            use_parallel_residual=True, rope_parameters={**rope, "partial_rotary_factor": 0.5}, **COMMON),
        "phi": lambda: t.PhiConfig(rope_parameters={**rope, "partial_rotary_factor": 0.5}, **COMMON),
        "phi-qk-layernorm": lambda: t.PhiConfig(qk_layernorm=True, **COMMON),
        # Untied (Cohere 2 keeps the tied head): with this one's tied head the tiny random layers let a
        # token map back to itself and greedy repeat it, a degenerate oracle (oracle.py).
        "cohere": lambda: t.CohereConfig(use_qk_norm=True, logit_scale=0.5, tie_word_embeddings=False, **COMMON),
        "cohere2": lambda: t.Cohere2Config(
            sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], logit_scale=0.5, **COMMON),
    }
    return configs[name]()


FAMILIES = ["olmo2", "olmo3", "granite", "stablelm", "stablelm-parallel", "phi", "phi-qk-layernorm", "cohere",
            "cohere2"]


def _assert_matches(model, model_config, hf_model, prompts: list[list[int]], next_tokens: list[int]) -> None:
    prefill, decode = _logits(model, model_config, prompts, next_tokens)
    for i, (prompt, token) in enumerate(zip(prompts, next_tokens)):
        ref_prefill, ref_step = hf_prompt_and_step(hf_model, prompt, token)
        torch.testing.assert_close(prefill[i], ref_prefill, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(decode[i], ref_step, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_transformers(name: str, tmp_path) -> None:
    """Logits of batched prompts (1 to 21 tokens: inside, across and past the window) and of the
    decode step after them equal transformers', with the C++ decode kernel and the torch path."""
    hf_model = random_hf_model(family_config(name))
    hf_model.save_pretrained(tmp_path)
    model_config = load_model_config(str(tmp_path), dtype="float32")
    model = build_model(model_config, "cpu")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    for use_kernel in (True, False):
        for module in model.modules():
            if isinstance(module, PagedAttention):
                module.use_cpu_kernel = use_kernel
        _assert_matches(model, model_config, hf_model, prompts, [5, 17, 101, 42])
    # Every op of these families has a C++ layer-loop kernel: where this CPU packs float32 panels the
    # loop ran the steps above (and matched transformers), elsewhere only the weights kept the Python
    # layers (test_layer_programs.py runs them in the loop with int8 rows too).
    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.use_cpu_kernel = True
    gaps = {gap for program in model_programs(model.model) for gap in program.gaps}
    assert all("a weight torch or oneDNN multiplies" in gap for gap in gaps), gaps
    assert (model.model._stack is not None) == (not gaps)


@pytest.mark.parametrize("name", FAMILIES)
def test_engine_greedy_equals_transformers(name: str, tokenizer, tmp_path) -> None:
    """Through the engine (scheduler, block manager, sampler): greedy tokens equal transformers'
    token for token, and every block goes back to the pool."""
    assert_engine_greedy_equals_transformers(random_hf_model(family_config(name)), tokenizer, str(tmp_path))


def test_settings_reach_the_layers(tmp_path) -> None:
    """The settings the equality tests exercise, read off the built models (were transformers to
    ignore a setting as we do, the equality would hold without them)."""
    built = {}
    for name in ("granite", "olmo3", "cohere2", "phi", "stablelm"):
        random_hf_model(family_config(name)).save_pretrained(tmp_path / name)
        built[name] = build_model(load_model_config(str(tmp_path / name), dtype="float32"), "cpu")
    granite = built["granite"]
    assert granite.model.embed_scale == 12.0 and granite.logit_scale == pytest.approx(1 / 8)
    assert all(layer.ops.residual_scale == 0.22 and layer.self_attn.attn.scale == 1 / 64
               for layer in granite.model.layers)
    olmo3 = built["olmo3"].model.layers
    assert [layer.self_attn.attn.sliding_window for layer in olmo3] == [WINDOW, None]
    assert all(layer.ops.wiring == POST_NORM and not hasattr(layer, "input_layernorm") for layer in olmo3)
    assert [layer.ops.attention.rotates for layer in built["cohere2"].model.layers] == [True, False]
    assert built["cohere2"].tie_word_embeddings and built["cohere2"].logit_scale == 0.5
    phi = built["phi"]
    assert phi.lm_head.bias is not None and phi.model.layers[0].ops.wiring == PARALLEL_SHARED
    assert not hasattr(phi.model.layers[0], "post_attention_layernorm")
    assert tuple(built["stablelm"].model.layers[0].self_attn.q_norm.weight.shape) == (4, 16)


@pytest.mark.parametrize("name", ["olmo2", "stablelm", "cohere"])
def test_head_spanning_qk_norms_refuse_tensor_parallelism(name: str) -> None:
    """OLMo 2's q/k norms take their statistics over all heads, StableLM's and Cohere's hold a weight
    per head: a rank holding some heads cannot compute them, so building the rank's shard is refused
    (Phi's per-head norm, one weight for every head, builds)."""
    from pagedllm.layers.parallel_state import override_tp_state
    from pagedllm.models.decoder import DecoderForCausalLM

    with override_tp_state(0, 2), torch.device("meta"):
        with pytest.raises(ValueError, match="not supported with tensor parallelism"):
            DecoderForCausalLM(family_config(name))
        DecoderForCausalLM(family_config("phi-qk-layernorm"))


# ---------------------------------------------------------------- GGUF, as llama.cpp writes these architectures


def gguf_config(arch: str):
    t = transformers
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    four_layers = {**COMMON, "num_hidden_layers": 4}  # llama.cpp's fixed pattern: 3 sliding layers, then a global one
    configs = {
        "olmo2": lambda: t.Olmo2Config(**COMMON),
        "olmo3": lambda: t.Olmo3Config(sliding_window=WINDOW, **four_layers),
        "granite": lambda: t.GraniteConfig(**GRANITE, **COMMON),
        "stablelm": lambda: t.StableLmConfig(
            qk_layernorm=True, use_qkv_bias=True, rope_parameters={**rope, "partial_rotary_factor": 0.25}, **COMMON),
        "stablelm-parallel": lambda: t.StableLmConfig(
            use_parallel_residual=True, rope_parameters={**rope, "partial_rotary_factor": 0.5}, **COMMON),
        # llama.cpp's converter writes 4 * hidden as Phi-2's MLP width and as many KV heads as heads.
        "phi2": lambda: t.PhiConfig(rope_parameters={**rope, "partial_rotary_factor": 0.5},
                                    **{**COMMON, "intermediate_size": 256, "num_key_value_heads": 4}),
        "command-r": lambda: t.CohereConfig(use_qk_norm=True, logit_scale=0.5, **COMMON),
        "cohere2": lambda: t.Cohere2Config(sliding_window=WINDOW, logit_scale=0.5, **four_layers),
    }
    return configs[arch]()


# (test name, the GGUF architecture llama.cpp writes it as)
GGUF_ARCHS = [("olmo2", "olmo2"), ("olmo3", "olmo2"), ("granite", "granite"), ("stablelm", "stablelm"),
              ("stablelm-parallel", "stablelm"), ("phi2", "phi2"), ("command-r", "command-r"),
              ("cohere2", "cohere2")]


@pytest.mark.parametrize(("name", "arch"), GGUF_ARCHS)
def test_gguf_matches_transformers(name: str, arch: str, tokenizer, tmp_path) -> None:
    """The model written as a GGUF file loads back (config from the metadata, weights from the
    tensors) to transformers' logits; with Q8_0 weights the packed path equals the same file dequantized."""
    hf_model = random_hf_model(gguf_config(name))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in (1, 9, 19)]
    next_tokens = [7, 70, 170]

    path = write_family_gguf(hf_model, tokenizer, arch, str(tmp_path / f"{name}-f32.gguf"))
    model_config = load_model_config(path)
    assert model_config.hf_config.model_type == hf_model.config.model_type
    model = build_model(model_config, "cpu")
    _assert_matches(model, model_config, hf_model, prompts, next_tokens)

    path = write_family_gguf(hf_model, tokenizer, arch, str(tmp_path / f"{name}-q8.gguf"), weight_type="Q8_0")
    packed_config = load_model_config(path)
    packed_config.int8_activations = False  # float activations: the dequantized model's results
    packed = build_model(packed_config, "cpu")
    assert sum(isinstance(getattr(m, "weight", None), QuantizedWeight) for m in packed.modules()) >= 5
    reference = build_model(load_model_config(path, quantization="dequantize"), "cpu")
    got, expected = (_logits(m, packed_config, prompts, next_tokens) for m in (packed, reference))
    torch.testing.assert_close(torch.cat(got[0]), torch.cat(expected[0]), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got[1], expected[1], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(("name", "arch"), [("command-r", "command-r"), ("phi2", "phi2")])
def test_gguf_engine_greedy(name: str, arch: str, tokenizer, tmp_path) -> None:
    """From a GGUF file through the engine: greedy tokens equal transformers', no block leaked."""
    hf_model = random_hf_model(gguf_config(name))
    path = write_family_gguf(hf_model, tokenizer, arch, str(tmp_path / f"{name}.gguf"))
    llm = LLM(path, block_size=4, num_kv_blocks=64)
    prompts = [[(5 * i + n) % 380 + 4 for i in range(n)] for n in (4, 13)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    hf_model.save_pretrained(tmp_path / "hf")
    assert got == hf_greedy(str(tmp_path / "hf"), prompts, 12)
    assert_no_leaks(llm)
