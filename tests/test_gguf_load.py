"""The GGUF load's fast paths: one parse of the header per load, arrays parsed whole (the same
values as gguf-py's element-by-element reader), the tokenizer built from that parse (the one
transformers builds from the file), tensors used where they lie in the mapped file, and q/k/v and
gate/up tiled part by part for int8 activations (the joined weight's tiling, byte for byte)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf_models import KV_HEADS, Q4_K_M, write_tiny_llama_gguf

from pagedllm.models import build_model, gguf_loader, load_model_config, load_tokenizer
from pagedllm.models.gguf_loader import forget_parsed_gguf, iter_gguf_weights, read_gguf
from pagedllm.quantization import apply
from pagedllm.quantization.mapped_file import as_tensor, in_mapped_file, map_file, release_pages
from pagedllm.quantization.packed import PackedTensor, QuantizedWeight

VOCAB = 211


def _write_metadata_gguf(path: str) -> str:
    """A GGUF of metadata arrays of every kind (strings with multi-byte and empty entries)."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("test.strings", ["", "a", "ünï", "漢字", "\u0120the", "x" * 300])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.25, 3.0e-8])
    writer.add_array("test.bools", [True, False, True])
    writer.add_uint32("test.scalar", 7)
    writer.add_string("test.string", "hello")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_arrays_equal_gguf_py(tmp_path):
    """Every metadata value as gguf-py's reader gives it (arrays of strings, ints, floats, bools)."""
    from gguf import GGUFReader

    path = _write_metadata_gguf(str(tmp_path / "meta.gguf"))
    ours = read_gguf(path).metadata
    reference = GGUFReader(path)
    for key in ("test.strings", "test.ints", "test.floats", "test.bools", "test.scalar", "test.string"):
        expected = reference.fields[key].contents()
        assert ours[key] == expected, key


def test_truncated_string_array_is_a_clear_error(tmp_path):
    path = _write_metadata_gguf(str(tmp_path / "meta.gguf"))
    with open(path, "rb") as f:
        head = f.read()
    cut = head.index(b"x" * 300) + 100  # inside the last string of the array
    with open(path, "wb") as f:
        f.write(head[:cut])
    forget_parsed_gguf()
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_gguf(path)


def test_header_parsed_once_per_load(tmp_path, monkeypatch):
    """Config, tokenizer and weights share one parse; a changed file is parsed again."""
    path = write_tiny_llama_gguf(str(tmp_path / "model.gguf"), "Q8_0", VOCAB)
    parses = []
    parse = gguf_loader._parse_gguf
    monkeypatch.setattr(gguf_loader, "_parse_gguf", lambda p: parses.append(p) or parse(p))
    forget_parsed_gguf()
    model_config = load_model_config(path, dtype="float32")
    build_model(model_config, "cpu")
    assert len(parses) == 1
    assert read_gguf(path) is read_gguf(path)
    os.utime(path, ns=(0, 0))  # a rewritten file: its header is read again
    read_gguf(path)
    assert len(parses) == 2
    forget_parsed_gguf()
    read_gguf(path)
    assert len(parses) == 3


def test_tokenizer_is_transformers_own_without_its_reader(monkeypatch):
    """The tokenizer built from the parsed header is the one transformers builds from the file,
    and transformers' own GGUF reader does not run for it."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import reader

    model_config = load_model_config(None)
    path = model_config.gguf_file
    folder, name = os.path.split(path)
    reference = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name, local_files_only=True)

    def refuse(*args, **kwargs):
        raise AssertionError("transformers read the GGUF header again")

    monkeypatch.setattr(reader, "_read_metadata", refuse)
    ours = load_tokenizer(model_config)
    assert ours.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert ours.special_tokens_map == reference.special_tokens_map
    assert ours.chat_template == reference.chat_template
    assert repr(ours.init_kwargs) == repr(reference.init_kwargs)
    for text in ("Hello world", "  two spaces\tand a tab\n", "ünïcödé 漢字 🙂 1234567"):
        assert ours(text).input_ids == reference(text).input_ids
    assert reader.read_gguf_metadata.__module__ == reader.__name__  # put back after the load


def test_packed_tensors_are_views_of_the_mapped_file(tmp_path):
    """Packed tensors not reordered (all but q / k of a Llama) are the file's bytes in place."""
    path = write_tiny_llama_gguf(str(tmp_path / "model.gguf"), "Q4_0", VOCAB)
    forget_parsed_gguf()
    gguf_file = read_gguf(path)
    with open(path, "rb") as f:
        raw = f.read()
    in_place = 0
    for name, tensor in iter_gguf_weights(gguf_file):
        if not isinstance(tensor, PackedTensor):
            continue
        if "q_proj" in name or "k_proj" in name:  # rows put back in HF's order: a copy
            assert not in_mapped_file(tensor.data)
            continue
        assert in_mapped_file(tensor.data)
        info = next(i for i in gguf_file.tensors.values() if gguf_loader.gguf_name_to_hf(i.name) == name)
        assert tensor.data.numpy().tobytes() == raw[info.offset:info.offset + info.nbytes]
        in_place += 1
    assert in_place >= 8


def test_released_pages_read_back_the_same(tmp_path):
    path = str(tmp_path / "blob.bin")
    data = np.random.default_rng(0).integers(0, 256, size=5 * 2**20, dtype=np.uint8)
    data.tofile(path)
    view = as_tensor(map_file(path)[12345:12345 + 3 * 2**20])
    before = view.clone()
    assert release_pages(view) > 2 * 2**20  # whole pages inside the view
    assert torch.equal(view, before)
    assert release_pages(before) == 0  # not in a mapping


@pytest.mark.kernels
@pytest.mark.parametrize("types", ["Q4_0", Q4_K_M])
def test_parts_tiled_apart_equal_the_joined_tiling(types, tmp_path, monkeypatch):
    """q/k/v and gate/up tiled part by part and joined are the tiling of the joined packed rows,
    one segment per layer as before, and (in the tile arena) a view, not a copy."""
    from pagedllm.quantization.int8_tiles import Int8TiledTensor, int8_tiling_reason, tile_for_int8

    if int8_tiling_reason(torch.device("cpu")) is not None:
        pytest.skip(int8_tiling_reason(torch.device("cpu")))
    path = write_tiny_llama_gguf(str(tmp_path / "model.gguf"), types, VOCAB)
    model_config = load_model_config(path, dtype="float32")
    model_config.int8_activations = True
    tiled_rows = []
    tile = apply.tile_for_int8
    monkeypatch.setattr(apply, "tile_for_int8", lambda data, *a: tiled_rows.append(data.shape[0]) or tile(data, *a))
    model = build_model(model_config, "cpu")
    # k tiled on its own (KV_HEADS * 64 rows), not joined with q (and v) first.
    assert KV_HEADS * 64 in tiled_rows
    storages = set()
    loaded = dict(iter_gguf_weights(read_gguf(path)))
    checked = 0
    for layer_index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{layer_index}"
        for module, parts in ((layer.self_attn.qkv_proj, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                              (layer.mlp.gate_up_proj, ("mlp.gate_proj", "mlp.up_proj"))):
            weight = module.weight
            assert isinstance(weight, QuantizedWeight)
            packed = [loaded[f"{prefix}.{part}.weight"] for part in parts]
            remaining, offset = list(packed), 0
            for seg in weight.segments:  # each run of one format: one tiled segment, as before
                run, rows = [], 0
                while rows < seg.rows:
                    run.append(remaining.pop(0))
                    rows += run[-1].shape[0]
                assert rows == seg.rows and seg.offset == offset
                assert isinstance(seg.weight, Int8TiledTensor)
                expected = tile_for_int8(torch.cat([p.data for p in run]), run[0].fmt, run[0].in_features)
                assert torch.equal(seg.weight.data, expected.data)
                offset += seg.rows
                checked += 1
            assert not remaining
            storages |= {seg.weight.data.untyped_storage().data_ptr() for seg in weight.segments}
    assert checked >= 4
    assert len(storages) == 1  # tiled one after another into one arena, joined as views: no copies
