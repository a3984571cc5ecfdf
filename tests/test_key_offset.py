"""The key offset of a quantized KV cache (attention/key_offset.py): measured at start-up as each
layer's mean key, subtracted from every key the cache stores, invisible to attention's softmax."""

from __future__ import annotations

import pytest
import torch
from test_sharing import BS

from pagedllm import LLM
from pagedllm.attention import PagedAttention, key_offset
from pagedllm.attention.key_offset import CALIBRATION_TOKENS, KeyStatistics, calibrate_key_offsets, offset_layers
from pagedllm.attention.kv_quant import roundtrip
from pagedllm.kv_cache_format import FORMATS


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory):
    return tiny_model_factory("llama-hd64")


def _attention_layers(llm: LLM) -> list[PagedAttention]:
    return [m for m in llm.llm_engine.worker.model.modules() if isinstance(m, PagedAttention)]


def test_offset_is_the_mean_key_after_the_first_position(llama_dir) -> None:
    """Each layer's offset is the mean of the keys it computes in the calibration pass, over
    positions 1..: checked against the keys captured from the same pass run again."""
    llm = LLM(model=llama_dir, num_kv_blocks=32, block_size=BS, kv_cache_dtype="int4")
    layers = _attention_layers(llm)
    assert layers and all(layer.key_offset is not None for layer in layers)
    model = llm.llm_engine.worker.model
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_pre_hook(lambda m, args, i=i: captured.__setitem__(i, args[1].clone()))
        for i, layer in enumerate(layers)
    ]
    try:
        offsets = [layer.key_offset for layer in layers]
        vocab_size = llm.llm_engine.model_config.hf_config.vocab_size
        assert calibrate_key_offsets(model, vocab_size, torch.device("cpu"), 4096) == len(layers)
    finally:
        for hook in hooks:
            hook.remove()
    for i, layer in enumerate(layers):
        keys = captured[i].view(CALIBRATION_TOKENS, layer.num_kv_heads, layer.head_dim)
        torch.testing.assert_close(layer.key_offset, keys[1:].float().mean(0), rtol=1e-5, atol=1e-6)
        assert torch.equal(layer.key_offset, offsets[i])  # the same seeded ids: the same offsets
        assert layer.key_statistics is None


def test_float_cache_keeps_no_offset(llama_dir) -> None:
    llm = LLM(model=llama_dir, num_kv_blocks=32, block_size=BS)
    assert all(layer.key_offset is None for layer in _attention_layers(llm))


def test_float8_cache_keeps_no_offset(llama_dir) -> None:
    """A float8 value's step follows its own magnitude: a shared bias costs it nothing."""
    llm = LLM(model=llama_dir, num_kv_blocks=32, block_size=BS, kv_cache_dtype="fp8")
    assert all(layer.key_offset is None for layer in _attention_layers(llm))


def test_no_calibration_tokens_no_offset(llama_dir, monkeypatch) -> None:
    """How benchmarks/kv_cache_dtype.py measures a cache without the offset."""
    monkeypatch.setattr(key_offset, "CALIBRATION_TOKENS", 0)
    llm = LLM(model=llama_dir, num_kv_blocks=32, block_size=BS, kv_cache_dtype="int8")
    assert all(layer.key_offset is None for layer in _attention_layers(llm))


def test_soft_capped_layers_keep_no_offset() -> None:
    """tanh does not commute with a shift of the logits: those layers are left out."""
    capped = PagedAttention(4, 64, 2, 0.125, logits_soft_cap=30.0)
    plain = PagedAttention(4, 64, 2, 0.125)
    model = torch.nn.ModuleList([capped, plain])
    assert offset_layers(model) == [plain]


def test_statistics_refuse_an_empty_pass() -> None:
    with pytest.raises(RuntimeError, match="no keys"):
        KeyStatistics().mean()


def test_offset_shrinks_the_error_of_biased_keys() -> None:
    """Keys sharing a large per-channel bias: stored less their mean, a 4-bit row spends its range
    on what varies between tokens."""
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(2, 64, generator=gen) * 6
    keys = torch.randn(200, 2, 64, generator=gen) + bias
    offset = keys.mean(0)
    plain = (roundtrip(keys, FORMATS["int4"]) - keys).norm()
    shifted = (roundtrip(keys, FORMATS["int4"], offset) + offset - keys).norm()
    assert shifted < 0.4 * plain
