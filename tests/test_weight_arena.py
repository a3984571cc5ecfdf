"""Packed CPU weights moved into one huge-page mapping after loading (models/weight_arena.py): every
packed weight in it, the model's outputs unchanged."""

from __future__ import annotations

import pytest
import torch
from gguf_models import write_tiny_llama_gguf
from test_layer_stack import MIXED, _build, _step_logits
from test_models import TINY

from pagedllm.kernels import use_kernel_config
from pagedllm.layers.cpu_gemm import panels_supported
from pagedllm.models import build_model, load_model_config
from pagedllm.models.weight_arena import _weight_slots
from pagedllm.quantization.int8_tiles import int8_tiling_reason

pytestmark = pytest.mark.kernels


def _storages(model, tiles: bool = False) -> set[int]:
    """The storages of the weights the arena moves (tiles=False) or of the int8 tilings (True), which
    are tiled straight into an arena of their own and stay there."""
    from pagedllm.quantization.int8_tiles import Int8TiledTensor

    tiled = set()
    for module in model.modules():
        for seg in getattr(getattr(module, "weight", None), "segments", []):
            if isinstance(seg.weight, Int8TiledTensor):
                tiled.add(id(seg.weight.data))
    return {tensor.untyped_storage().data_ptr() for tensor, _ in _weight_slots(model) if (id(tensor) in tiled) == tiles}


def _gguf_model(path: str):
    model_config = load_model_config(path, dtype="float32")
    return model_config, build_model(model_config, "cpu")


@pytest.mark.parametrize("kind", ["panels", "gguf"])
def test_weights_move_into_one_arena_and_compute_the_same(kind, tmp_path, monkeypatch):
    """Panel-packed float weights (with the LM head), or a GGUF's segments of several kinds (packed
    blocks, int8 tiles where this CPU has them, float rows): one storage for all, the same logits
    as the weights where they were loaded."""
    if kind == "panels" and not panels_supported(torch.float32):
        pytest.skip("no panel-packed float32 weights on this CPU")
    if kind == "panels":
        model_config, model = _build(tmp_path, TINY["llama-gqa"], "float32")
    else:
        path = write_tiny_llama_gguf(str(tmp_path / "model.gguf"), MIXED, 211)
        model_config, model = _gguf_model(path)
    assert len(_weight_slots(model)) >= 4 * model_config.hf_config.num_hidden_layers
    assert len(_storages(model)) == 1
    if kind == "gguf" and int8_tiling_reason(torch.device("cpu")) is None:
        assert len(_storages(model, tiles=True)) == 1
    moved = _step_logits(model, model_config)

    with use_kernel_config(huge_pages=False):
        if kind == "panels":
            model_config, model = _build(tmp_path, TINY["llama-gqa"], "float32")
        else:
            model_config, model = _gguf_model(path)
    assert len(_storages(model)) > 1
    for a, b in zip(moved, _step_logits(model, model_config), strict=True):
        assert torch.equal(a, b)
