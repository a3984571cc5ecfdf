"""The families taken from transformers' decoder-only architectures, against transformers on tiny
random models through the paged KV cache and the engine.

Each is the one decoder configured by its Family entry: Llama under other names and configs
(EXAONE 3, InternLM 3, IQuest-Coder, CWM, Ministral, Seed-OSS), layers without rope (SmolLM3's
no_rope_layers, EXAONE 4's full-attention layers), rope over channel pairs (Helium, ERNIE 4.5; GLM
and GLM-4 over part of each head), GLM-4's norms around each block, VaultGemma's Gemma 2 without
two of its norms, and the OLMoE / FlexOlmo / Mellum mixtures of experts. The dense ones also run in
the C++ layer loop: test_layer_programs.py holds their programs to no gaps.
"""

from __future__ import annotations

import pytest
from conftest import train_tokenizer
from oracle import assert_engine_greedy_equals_transformers
from requirements_here import require
from test_model_families import VOCAB, WINDOW, random_hf_model
from test_moe_families import assert_logits_match, prompts_for

from pagedllm.kernels.codes import SANDWICH
from pagedllm.models import build_model, load_model_config

transformers = require("transformers")

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, bos_token_id=1,
              eos_token_id=2, pad_token_id=3)
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]
EXPERTS = dict(num_experts=4, num_experts_per_tok=2)


def family_config(name: str):
    t = transformers
    configs = {
        "helium": lambda: t.HeliumConfig(head_dim=16, attention_bias=True, **COMMON),
        "glm": lambda: t.GlmConfig(head_dim=16, **COMMON),  # rope over the first half of each head
        "glm4": lambda: t.Glm4Config(head_dim=16, **COMMON),
        "exaone": lambda: t.ExaoneConfig(**COMMON),
        "internlm3": lambda: t.InternLM3Config(head_dim=16, attention_bias=True, mlp_bias=True, **COMMON),
        "iquestcoder": lambda: t.IQuestCoderConfig(head_dim=16, **COMMON),
        "cwm": lambda: t.CwmConfig(
            head_dim=16, sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention"],
            rope_parameters={"rope_type": "llama3", "rope_theta": 1e6, "factor": 4.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            **COMMON),
        "ministral": lambda: t.MinistralConfig(head_dim=16, sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL,
                                               **COMMON),
        # q/k/v biased, o not: a decoder reading o's bias from attention_bias finds no tensor for it.
        "seed_oss": lambda: t.SeedOssConfig(head_dim=16, attention_bias=True, attention_out_bias=False,
                                            mlp_bias=True, **COMMON),
        # Layer 0 rotates, layer 1 does not and attends through the window.
        "smollm3": lambda: t.SmolLM3Config(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=WINDOW,
                                           **COMMON),
        "ernie4_5": lambda: t.Ernie4_5Config(head_dim=16, use_bias=True, **COMMON),
        "vaultgemma": lambda: t.VaultGemmaConfig(
            head_dim=16, sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL, query_pre_attn_scalar=16,
            attn_logit_softcapping=5.0, final_logit_softcapping=3.0, tie_word_embeddings=False, **COMMON),
        # Layer 0 slides with rope, layer 1 attends globally without it.
        "exaone4": lambda: t.Exaone4Config(head_dim=16, sliding_window=WINDOW, sliding_window_pattern=2, **COMMON),
        # No window in the model: every layer rotates. Tied: untied, these random weights make greedy
        # repeat one token after one of the prompts, a degenerate oracle (oracle.py).
        "exaone4-global": lambda: t.Exaone4Config(head_dim=16, sliding_window=None, tie_word_embeddings=True,
                                                  layer_types=["full_attention"] * 2, **COMMON),
        "olmoe": lambda: t.OlmoeConfig(**EXPERTS, **COMMON),
        "flex_olmo": lambda: t.FlexOlmoConfig(**EXPERTS, **COMMON),
        "mellum": lambda: t.MellumConfig(
            head_dim=16, moe_intermediate_size=32, sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL,
            mlp_layer_types=["dense", "sparse"], **EXPERTS, **COMMON),
    }
    return configs[name]()


DENSE = ["helium", "glm", "glm4", "exaone", "internlm3", "iquestcoder", "cwm", "ministral", "seed_oss", "smollm3",
         "ernie4_5", "vaultgemma", "exaone4", "exaone4-global"]
MOE = ["olmoe", "flex_olmo", "mellum"]
FAMILIES = DENSE + MOE


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_transformers(name: str, tmp_path) -> None:
    """Logits of batched prompts (1 to 21 tokens: inside, across and past the window) and of the
    decode step after them equal transformers', with the C++ decode kernel and the torch path."""
    hf_model = random_hf_model(family_config(name))
    hf_model.save_pretrained(tmp_path)
    model_config = load_model_config(str(tmp_path), dtype="float32")
    assert_logits_match(build_model(model_config, "cpu"), model_config, hf_model, prompts_for(1))


@pytest.mark.parametrize("name", FAMILIES)
def test_engine_greedy_equals_transformers(name: str, tokenizer, tmp_path) -> None:
    """Through the engine: greedy tokens equal transformers' (a reference checked not to repeat one
    token), and every block goes back to the pool."""
    assert_engine_greedy_equals_transformers(random_hf_model(family_config(name)), tokenizer, str(tmp_path))


def _built(tmp_path, name: str):
    random_hf_model(family_config(name)).save_pretrained(tmp_path / name)
    return build_model(load_model_config(str(tmp_path / name), dtype="float32"), "cpu")


def test_settings_reach_the_layers(tmp_path) -> None:
    """The settings the equality tests exercise, read off the built models (were transformers to
    ignore a setting as we do, the equality would hold without them)."""
    uses_rope = {name: [layer.ops.attention.rotates for layer in _built(tmp_path, name).model.layers]
                 for name in ("smollm3", "exaone4", "exaone4-global")}
    assert uses_rope == {"smollm3": [True, False], "exaone4": [True, False], "exaone4-global": [True, True]}
    seed = _built(tmp_path, "seed_oss").model.layers[0].self_attn
    assert seed.qkv_proj.bias is not None and seed.o_proj.bias is None
    glm4 = _built(tmp_path, "glm4").model.layers[0]
    assert glm4.ops.wiring == SANDWICH and glm4.self_attn.attn.sliding_window is None
    vault = _built(tmp_path, "vaultgemma")
    layer = vault.model.layers[0]
    assert not hasattr(layer, "pre_feedforward_layernorm") and not hasattr(layer, "post_feedforward_layernorm")
    assert vault.model.embed_scale == 64**0.5 and vault.final_logit_softcapping == 3.0
    mellum = _built(tmp_path, "mellum").model.layers
    assert [type(layer.mlp).__name__ for layer in mellum] == ["GatedMLP", "SparseMoE"]
