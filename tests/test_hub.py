"""Hub ids: a hub cache in huggingface_hub's own layout, loaded offline; file choice from repo listings."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket

import huggingface_hub
import pytest
from gguf_models import write_tiny_llama_gguf
from huggingface_hub import constants
from huggingface_hub.file_download import repo_folder_name

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.cli import main as cli_main
from pagedllm.models import hub, load_model_config, resolve_model_path
from pagedllm.models.hub import choose_files, download_model, is_hub_id, pick_gguf

COMMIT = "0123456789abcdef0123456789abcdef01234567"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SMALL = dict(num_kv_blocks=32, block_size=8, device="cpu", dtype="float32", num_threads=1)


def add_to_cache(cache_dir: str, repo_id: str, files: dict[str, str], commit: str = COMMIT) -> str:
    """Put files (repo name -> source path) in the cache as huggingface_hub lays it out:
    blobs named by content hash, snapshots/<commit>/ linking to them, refs/main naming the commit."""
    storage = os.path.join(cache_dir, repo_folder_name(repo_id=repo_id, repo_type="model"))
    snapshot = os.path.join(storage, "snapshots", commit)
    for name, source in files.items():
        with open(source, "rb") as f:
            blob = os.path.join(storage, "blobs", hashlib.sha256(f.read()).hexdigest())
        os.makedirs(os.path.dirname(blob), exist_ok=True)
        shutil.copyfile(source, blob)
        link = os.path.join(snapshot, name)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    os.makedirs(os.path.join(storage, "refs"), exist_ok=True)
    with open(os.path.join(storage, "refs", "main"), "w") as f:
        f.write(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> str:
    """An empty hub cache under a temp HF_HOME, offline. huggingface_hub reads HF_HOME and HF_HUB_OFFLINE
    into constants at import, so the constants are patched too (the functions read them at call time)."""
    cache_dir = str(tmp_path / "hf" / "hub")
    os.makedirs(cache_dir)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache_dir)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache_dir


@pytest.fixture
def no_network(monkeypatch) -> None:
    """Any attempt to open an internet connection fails the test."""
    real_connect = socket.socket.connect

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"network access to {address}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)


def cache_folder(cache_dir: str, repo_id: str, folder: str) -> str:
    files = {name: os.path.join(folder, name) for name in os.listdir(folder)}
    return add_to_cache(cache_dir, repo_id, files)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    outputs = llm.generate(["The quick brown fox", "Paged memory"], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


# --- hub ids and the choice of files (the online path's decisions, from repo listings) ---


@pytest.mark.parametrize("reference, expected", [
    ("org/tiny", True), ("Qwen/Qwen3-0.6B", True), ("org/tiny-gguf:Q4_K_M", True), ("org/na.me_1", True),
    ("tiny", False), ("./org/tiny", False), ("/abs/org", False), ("a/b/c", False), ("org/na..me", False),
    ("org/na--me", False), ("org/", False), ("org/tiny:", False),
])
def test_is_hub_id(reference, expected) -> None:
    assert is_hub_id(reference) is expected


def test_safetensors_repo_never_fetches_bin_or_extras() -> None:
    listing = [
        ".gitattributes", "README.md", "config.json", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json", "merges.txt", "vocab.json", "chat_template.jinja",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
        "consolidated.safetensors", "pytorch_model.bin", "pytorch_model.bin.index.json", "onnx/model.onnx",
        "original/model.safetensors", "flax_model.msgpack", "model-Q4_K_M.gguf",
    ]
    assert choose_files("org/x", listing) == sorted([
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "merges.txt", "vocab.json", "chat_template.jinja",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
    ])


def test_sentence_transformers_repo_fetches_its_pooling_settings() -> None:
    """The embedding runner reads modules.json and the Pooling module's config to choose its pooling."""
    listing = ["config.json", "tokenizer.json", "model.safetensors", "modules.json", "1_Pooling/config.json",
               "config_sentence_transformers.json", "README.md", "2_Dense/model.safetensors"]
    assert choose_files("org/x", listing) == [
        "1_Pooling/config.json", "config.json", "model.safetensors", "modules.json", "tokenizer.json",
    ]


def test_bin_only_repo_fetches_bin() -> None:
    listing = ["config.json", "tokenizer.model", "pytorch_model.bin", "tf_model.h5"]
    assert choose_files("org/x", listing) == ["config.json", "pytorch_model.bin", "tokenizer.model"]


def test_repo_without_weights_is_refused() -> None:
    with pytest.raises(ValueError, match="no weights"):
        choose_files("org/x", ["config.json", "tf_model.h5"])


def test_tokenizer_only_fetches_tokenizer_files() -> None:
    listing = ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"]
    assert choose_files("org/x", listing, tokenizer_only=True) == ["config.json", "tokenizer.json",
                                                                   "tokenizer_config.json"]


GGUF_LISTING = [
    "README.md", "tiny-Q4_K_M.gguf", "tiny-Q4_K_S.gguf", "tiny-Q4_K.gguf", "tiny.Q8_0.gguf",
    "mmproj-tiny-f16.gguf", "BF16/tiny-BF16-00001-of-00002.gguf", "BF16/tiny-BF16-00002-of-00002.gguf",
]


@pytest.mark.parametrize("quant, expected", [
    ("Q8_0", "tiny.Q8_0.gguf"), ("q8_0", "tiny.Q8_0.gguf"), ("Q4_K_M", "tiny-Q4_K_M.gguf"),
    ("q4_k_s", "tiny-Q4_K_S.gguf"), ("Q4_K", "tiny-Q4_K.gguf"),
])
def test_quant_tag_picks_the_file(quant, expected) -> None:
    assert choose_files("org/tiny-gguf", GGUF_LISTING, quant=quant) == [expected]


def test_gguf_choice_errors() -> None:
    with pytest.raises(ValueError, match="several .gguf files") as err:
        pick_gguf("org/tiny-gguf", GGUF_LISTING)
    assert "tiny.Q8_0.gguf" in str(err.value) and "tiny-Q4_K_M.gguf" in str(err.value)
    assert "mmproj" not in str(err.value)
    with pytest.raises(ValueError, match="no .gguf file for quant 'IQ2_XS'.*tiny.Q8_0.gguf"):
        pick_gguf("org/tiny-gguf", GGUF_LISTING, quant="IQ2_XS")
    with pytest.raises(ValueError, match="split GGUF"):
        pick_gguf("org/tiny-gguf", GGUF_LISTING, quant="BF16-00001-of-00002")
    with pytest.raises(ValueError, match="no GGUF file 'nope.gguf'"):
        pick_gguf("org/tiny-gguf", GGUF_LISTING, gguf_file="nope.gguf")
    assert pick_gguf("org/tiny-gguf", GGUF_LISTING, gguf_file="tiny-Q4_K_S.gguf") == "tiny-Q4_K_S.gguf"
    assert pick_gguf("org/one", ["config.json", "one.gguf"]) == "one.gguf"


def test_online_path_lists_the_repo_then_fetches_only_the_chosen_files(tmp_path, monkeypatch) -> None:
    calls = {}
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files",
                        lambda self, repo_id, revision=None: ["config.json", "model.safetensors", "pytorch_model.bin",
                                                              "tokenizer.json"])

    def snapshot_download(repo_id, **kwargs):
        calls.update(kwargs, repo_id=repo_id)
        return str(tmp_path / "snap")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert download_model("org/x", revision="v1", download_dir=str(tmp_path / "d")) == str(tmp_path / "snap")
    assert calls == dict(repo_id="org/x", revision="v1", cache_dir=str(tmp_path / "d"),
                         allow_patterns=["config.json", "model.safetensors", "tokenizer.json"], local_files_only=False)


def test_unreachable_hub_falls_back_to_the_cache(hub_cache, tiny_model_factory, monkeypatch) -> None:
    snapshot = cache_folder(hub_cache, "org/tiny", tiny_model_factory("llama"))

    def unreachable(self, repo_id, revision=None):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", unreachable)
    assert download_model("org/tiny") == snapshot


# --- a populated cache, offline ---


def test_hub_id_generates_as_the_snapshot_folder(hub_cache, tiny_model_factory, no_network) -> None:
    snapshot = cache_folder(hub_cache, "org/tiny", tiny_model_factory("llama"))
    from_hub = LLM(model="org/tiny", **SMALL)
    assert from_hub.llm_engine.model_config.model == snapshot
    assert greedy_tokens(from_hub) == greedy_tokens(LLM(model=snapshot, **SMALL))


def test_gguf_repo_with_quant_and_tokenizer_hub_id(hub_cache, tiny_model_factory, tmp_path, no_network) -> None:
    folder = tiny_model_factory("llama")
    cache_folder(hub_cache, "org/tiny", folder)
    vocab = len(LLM(model=folder, **SMALL).get_tokenizer())
    q8 = write_tiny_llama_gguf(str(tmp_path / "tiny.Q8_0.gguf"), "Q8_0", vocab)
    q4 = write_tiny_llama_gguf(str(tmp_path / "tiny.Q4_0.gguf"), "Q4_0", vocab)
    snapshot = add_to_cache(hub_cache, "org/tiny-gguf", {"tiny.Q8_0.gguf": q8, "tiny.Q4_0.gguf": q4})

    from_hub = LLM(model="org/tiny-gguf:q8_0", tokenizer="org/tiny", int8_activations=False, **SMALL)
    assert from_hub.llm_engine.model_config.gguf_file == os.path.join(snapshot, "tiny.Q8_0.gguf")
    direct = LLM(model=q8, tokenizer=folder, int8_activations=False, **SMALL)
    assert greedy_tokens(from_hub) == greedy_tokens(direct)

    assert resolve_model_path("org/tiny-gguf", gguf_file="tiny.Q4_0.gguf") == os.path.join(snapshot, "tiny.Q4_0.gguf")
    with pytest.raises(ValueError, match="several .gguf files: tiny.Q4_0.gguf, tiny.Q8_0.gguf"):
        load_model_config("org/tiny-gguf")


def test_not_cached_offline_is_a_clear_error(hub_cache, no_network) -> None:
    with pytest.raises(ValueError, match="'org/missing' is not in the hub cache.*HF_HUB_OFFLINE"):
        LLM(model="org/missing", **SMALL)
    with pytest.raises(ValueError, match="not in the hub cache"):
        load_model_config("org/missing:Q4_K_M")


def test_missing_local_path_that_is_no_hub_id(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist.*hub id ORG/NAME"):
        resolve_model_path(str(tmp_path / "a" / "b" / "no-such-model"))


def test_local_path_never_reaches_the_hub(tiny_model_factory, monkeypatch) -> None:
    folder = tiny_model_factory("llama")

    def no_hub(*args, **kwargs):
        raise AssertionError("a local path reached the hub")

    monkeypatch.setattr(hub, "download_model", no_hub)
    assert resolve_model_path(folder) == folder
    # A relative path shaped like ORG/NAME stays a local path when it exists.
    parent, name = os.path.split(folder)
    monkeypatch.chdir(os.path.dirname(parent))
    assert resolve_model_path(os.path.join(os.path.basename(parent), name)) == folder


def test_local_load_opens_no_connection_and_leaves_the_environment(tiny_model_factory, monkeypatch,
                                                                   no_network) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    LLM(model=tiny_model_factory("llama"), **SMALL)
    assert "HF_HUB_OFFLINE" not in os.environ and "TRANSFORMERS_OFFLINE" not in os.environ


# --- the command line ---


def test_cli_download_prints_the_path(hub_cache, tiny_model_factory, capsys) -> None:
    snapshot = cache_folder(hub_cache, "org/tiny", tiny_model_factory("llama"))
    assert cli_main(["download", "org/tiny"]) == 0
    assert capsys.readouterr().out.strip() == snapshot


def test_cli_download_not_cached_fails_cleanly(hub_cache, capsys) -> None:
    assert cli_main(["download", "org/missing", "--revision", "v2"]) != 0
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "org/missing" in err and "HF_HUB_OFFLINE" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_models_lists_the_cache(hub_cache, tiny_model_factory, tmp_path, capsys) -> None:
    assert cli_main(["models"]) == 0
    assert "No models" in capsys.readouterr().out
    cache_folder(hub_cache, "org/tiny", tiny_model_factory("llama"))
    q8 = write_tiny_llama_gguf(str(tmp_path / "t.gguf"), "Q8_0", 64, hidden=64, ffn=128)
    add_to_cache(hub_cache, "org/tiny-gguf", {"tiny.Q8_0.gguf": q8}, commit="f" * 40)
    assert cli_main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["org/tiny", "org/tiny-gguf"]
    assert f"{COMMIT[:12]} (main)" in lines[0] and "f" * 12 in lines[1]


def test_cli_generate_runs_a_cached_hub_id_offline(hub_cache, tiny_model_factory, no_network, capsys) -> None:
    folder = tiny_model_factory("llama")
    cache_folder(hub_cache, "org/tiny", folder)
    args = ["generate", "Paged memory", "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--quiet",
            "--num-kv-blocks", "32", "--block-size", "8", "--dtype", "float32", "--num-threads", "1"]
    assert cli_main(args + ["--model", "org/tiny"]) == 0
    from_hub = capsys.readouterr().out.splitlines()
    assert cli_main(args + ["--model", folder]) == 0
    direct = capsys.readouterr().out.splitlines()
    # The completions match; the last line is the timing summary.
    assert from_hub[:-1] == direct[:-1] and "Paged memory" in from_hub[0]


def test_cli_generate_not_cached_fails_cleanly(hub_cache, capsys) -> None:
    assert cli_main(["generate", "hello", "--model", "org/missing:Q4_K_M", "--max-tokens", "2"]) != 0
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'org/missing:Q4_K_M'" in err and "HF_HUB_OFFLINE" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
