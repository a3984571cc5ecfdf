"""Every causal-LM architecture of the installed transformers is either served (a family of the one
decoder, or a model class of its own) or listed as not served with the op it lacks; the site's
reference/families.md is rendered from those tables (pagedllm/reference_pages/families_page.py, checked
by tests/test_reference_pages.py), and a refused model's error names the reason."""

from __future__ import annotations

import pytest
from requirements_here import require

from pagedllm.models import load_model_config
from pagedllm.models.families import FAMILIES, family_of
from pagedllm.models.registry import get_model_class, supported_architectures
from pagedllm.models.unsupported_families import UNSUPPORTED

transformers = require("transformers")


def _causal_lm_types() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _own_class(architecture: str) -> bool:
    """Served by a model class of its own (GPT-2, OPT, DeepSeek-V3), not the decoder."""
    from pagedllm.models.decoder import DecoderForCausalLM

    return architecture in supported_architectures() and get_model_class(architecture) is not DecoderForCausalLM


def test_every_causal_lm_of_transformers_is_classified() -> None:
    unclassified = [model_type for model_type, arch in _causal_lm_types().items()
                    if model_type not in FAMILIES and model_type not in UNSUPPORTED and not _own_class(arch)]
    assert not unclassified, f"judge these against the decoder (families.py or unsupported_families.py): {unclassified}"


def test_the_tables_do_not_overlap_or_name_unknown_types() -> None:
    assert not set(FAMILIES) & set(UNSUPPORTED)
    assert set(FAMILIES) | set(UNSUPPORTED) <= set(_causal_lm_types())
    assert all(reason and "\n" not in reason for reason in UNSUPPORTED.values())


def test_a_refused_model_names_what_the_decoder_lacks(tmp_path) -> None:
    config = transformers.OlmoConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                     num_attention_heads=4, architectures=["OlmoForCausalLM"])
    config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the architecture is refused first
    with pytest.raises(ValueError, match="model_type 'olmo' is not served: LayerNorm without weight or bias"):
        load_model_config(str(tmp_path))
    with pytest.raises(ValueError, match="model_type 'bloom' is not served: ALiBi positions"):
        family_of(transformers.BloomConfig())


def test_clip_qkv_is_refused() -> None:
    """OLMoE's optional clamp of q, k and v has no counterpart in the decoder's layers."""
    from pagedllm.models.families import decoder_settings

    config = transformers.OlmoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_experts=2, num_experts_per_tok=1, clip_qkv=8.0)
    with pytest.raises(ValueError, match="clip_qkv"):
        decoder_settings(config)
