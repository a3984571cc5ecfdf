"""GGUF files: metadata, a transformers config built from it, and dequantized weights under HF names.

The header is parsed here with ``struct`` over an mmap rather than with ``gguf.GGUFReader``: the
reader builds a numpy view per metadata element, which takes seconds on a 49k-token vocabulary.
Arrays of fixed-size values come out of one ``numpy.frombuffer``, arrays of strings out of one tight
loop over the header's bytes (a 128k-token vocabulary and 49k merges: ~0.15 s, where a call per
element took ~1.3 s), and a load parses each file once: ``read_gguf`` keeps its last answer for
the same unchanged file (the config, the tokenizer and the weights all start from it). Packed
tensors are views of one read-only mapping of the file (quantization/mapped_file.py), not copies.
Tensor data is dequantized with ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedllm.quantization.formats import GGUF_PACKED_TYPES, MXFP4
from pagedllm.quantization.mapped_file import as_tensor, map_file
from pagedllm.quantization.packed import PackedTensor

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
# GGUF architecture (llama.cpp's name) -> the transformers model_type of the same model.
GGUF_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "gptneox": "gpt_neox",
    "olmo2": "olmo2",  # and OLMo 3, which llama.cpp writes as OLMo 2 with a sliding window
    "granite": "granite",
    "stablelm": "stablelm",
    "phi2": "phi",
    "command-r": "cohere",
    "cohere2": "cohere2",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    # DeepSeek-V3 (and V2 / V2-Lite, which llama.cpp writes under the same name; only V3's sigmoid routing
    # is supported: check_gguf_supported refuses the others).
    "deepseek2": "deepseek_v3",
}
SUPPORTED_GGUF_ARCHITECTURES = tuple(GGUF_MODEL_TYPES)
# llama.cpp writes Mixtral as a "llama" with experts (``llama.expert_count``).
_LLAMA_WITH_EXPERTS = "mixtral"
# llama.cpp stores Gemma's norm weights with the 1 of ``1 + weight`` added.
_NORMS_PLUS_ONE = ("gemma2", "gemma3")
# Only llama.cpp's Llama (and Granite, converted as a Llama) permutes q/k rows for its interleaved rope;
# the others keep HF's rows (Cohere's interleaved rope included: its HF rows are what llama.cpp rotates).
_PERMUTED_ROPE = ("llama", "granite")
# Architectures with LayerNorm (``attention.layer_norm_epsilon``) rather than RMSNorm.
_LAYER_NORM_ARCHS = ("gptneox", "stablelm", "phi2", "command-r", "cohere2")
# Architectures whose files may carry yarn rope scaling (``rope.scaling.type`` "yarn").
_YARN_ARCHS = ("gpt-oss", "deepseek2")
# Tensors that hold settings, read into the config rather than loaded as weights.
_SETTING_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_FLOAT_TYPES = {0, 1, 30}  # F32, F16, BF16: loaded as float tensors
# The types kept packed: those the linears of every family take, and MXFP4 (llama.cpp's GPT-OSS experts).
_PACKED_TYPES = {**GGUF_PACKED_TYPES, MXFP4.name: MXFP4}
# llama.cpp's expert gating functions (``expert_gating_func``).
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2
# GPT-OSS's SwiGLU clamp, which llama.cpp fixes (a file's ``swiglu_clamp_exp`` says otherwise where it is set).
_GPT_OSS_SWIGLU_LIMIT = 7.0
_WARNED_TYPES: set[str] = set()

# Metadata value types of the GGUF spec -> struct format of the fixed-size ones.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_TYPE_STRING = 8
_TYPE_ARRAY = 9
_U64 = struct.Struct("<Q")
_NUMPY_OF_SCALAR = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
                    12: "<f8"}


@dataclass(slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy / torch order (GGUF stores dims innermost first)
    ggml_type: int
    offset: int  # absolute offset in the file
    nbytes: int


@dataclass(slots=True)
class GGUFFile:
    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


class _Cursor:
    """Reads little-endian GGUF values from a buffer, turning a short read into a clear error."""

    def __init__(self, buf: Any, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.size = len(buf)
        self.path = path

    def fail(self, what: str) -> ValueError:
        return ValueError(f"GGUF file {self.path!r} is truncated or corrupt: {what} (at byte {self.pos}).")

    def unpack(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise self.fail("the header ends early")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        if self.pos + length > self.size:
            raise self.fail(f"a string of {length} bytes runs past the end of the file")
        raw = bytes(self.buf[self.pos:self.pos + length])
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a vocabulary, a merge table): the loop of ``string`` without a
        method call, bounds check object or ``bytes`` copy per element."""
        buf, pos, size = self.buf, self.pos, self.size
        length_at = _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                (length,) = length_at(buf, pos)
                pos += 8
                end = pos + length
                if end > size:
                    raise self.fail(f"a string of {length} bytes runs past the end of the file")
                append(str(buf[pos:end], "utf-8", "replace"))
                pos = end
        except struct.error:
            self.pos = pos
            raise self.fail("the header ends early") from None
        self.pos = pos
        return out

    def value(self, value_type: int) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])
        if value_type == _TYPE_STRING:
            return self.string()
        if value_type == _TYPE_ARRAY:
            item_type = self.unpack("<I")
            count = self.unpack("<Q")
            if item_type in _NUMPY_OF_SCALAR:
                dtype = np.dtype(_NUMPY_OF_SCALAR[item_type])
                nbytes = count * dtype.itemsize
                if self.pos + nbytes > self.size:
                    raise self.fail(f"an array of {count} values runs past the end of the file")
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
                self.pos += nbytes
                return arr.tolist()
            if count > self.size:
                raise self.fail(f"an array claims {count} elements")
            if item_type == _TYPE_STRING:
                return self.strings(count)
            return [self.value(item_type) for _ in range(count)]
        raise self.fail(f"unknown metadata value type {value_type}")


def read_gguf(path: str) -> GGUFFile:
    """The header of a GGUF file (metadata and tensor table), tensor extents validated; shared, so
    read-only to callers. A load reads the header three times (config, tokenizer, weights): the last
    file parsed is kept and given again while its size, modification time and inode are unchanged."""
    global _last_parsed
    try:
        st = os.stat(path)
    except OSError as e:
        raise ValueError(f"Cannot read GGUF file {path!r}: {e}") from e
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    cached = _last_parsed
    if cached is not None and cached[0] == key:
        return cached[1]
    _last_parsed = None  # the previous file's strings go before the next file's are built
    gguf_file = _parse_gguf(path)
    _last_parsed = (key, gguf_file)
    return gguf_file


def forget_parsed_gguf() -> None:
    """Drop the kept header (its vocabulary and merges are tens of MB of strings) once a load is done."""
    global _last_parsed
    _last_parsed = None


_last_parsed: tuple[tuple[Any, ...], GGUFFile] | None = None


def _parse_gguf(path: str) -> GGUFFile:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            if file_size < 24:
                raise ValueError(f"GGUF file {path!r} is truncated or corrupt: only {file_size} bytes.")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ValueError(f"Cannot read GGUF file {path!r}: {e}") from e
    try:
        cur = _Cursor(buf, path)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise ValueError(f"{path!r} is not a GGUF file (magic bytes {bytes(buf[:4])!r}, expected b'GGUF').")
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF file {path!r} has unsupported version {version} (supported: 2, 3).")
        tensor_count = cur.unpack("<Q")
        kv_count = cur.unpack("<Q")
        if tensor_count > 1_000_000 or kv_count > 1_000_000:
            raise cur.fail(f"implausible counts ({tensor_count} tensors, {kv_count} metadata keys)")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("<I"))
        infos = []
        for _ in range(tensor_count):
            name = cur.string()
            n_dims = cur.unpack("<I")
            if n_dims > 8:
                raise cur.fail(f"tensor {name!r} has {n_dims} dimensions")
            dims = [cur.unpack("<Q") for _ in range(n_dims)]
            ggml_type = cur.unpack("<I")
            offset = cur.unpack("<Q")
            infos.append((name, dims, ggml_type, offset))
        alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        data_start = (cur.pos + alignment - 1) // alignment * alignment
        gguf_file = GGUFFile(path=path, metadata=metadata)
        for name, dims, ggml_type, offset in infos:
            try:
                qtype = GGMLQuantizationType(ggml_type)
                block_size, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise ValueError(f"GGUF file {path!r}: tensor {name!r} has unknown ggml type {ggml_type}.") from None
            numel = int(np.prod(dims)) if dims else 1
            if dims and dims[0] % block_size:
                raise cur.fail(f"tensor {name!r} row of {dims[0]} is not a multiple of the block size {block_size}")
            nbytes = numel // block_size * type_size
            start = data_start + offset
            if start + nbytes > file_size:
                raise ValueError(
                    f"GGUF file {path!r} is truncated or corrupt: tensor {name!r} needs bytes "
                    f"[{start}, {start + nbytes}) but the file has {file_size} bytes."
                )
            gguf_file.tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, start, nbytes)
        return gguf_file
    finally:
        buf.close()


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of q/k rows (it uses GPT-J style rope; HF Llama uses halves)."""
    d = w.shape[0]
    if w.ndim == 1:
        return w.reshape(n_head, d // n_head // 2, 2).swapaxes(1, 2).reshape(d)
    d_in = w.shape[1]
    return w.reshape(n_head, d // n_head // 2, 2, d_in).swapaxes(1, 2).reshape(d, d_in)


def _arch_key(meta: dict[str, Any], arch: str, key: str, default: Any = None) -> Any:
    return meta.get(f"{arch}.{key}", default)


def check_gguf_supported(gguf_file: GGUFFile) -> None:
    arch = gguf_file.architecture
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {gguf_file.path!r} has architecture {arch!r}; pagedllm loads GGUF models of architecture "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} only (use a Hugging Face folder for others)."
        )
    if "rope_freqs.weight" in gguf_file.tensors and arch == "llama":
        raise ValueError(
            f"GGUF file {gguf_file.path!r} carries per-frequency rope factors (rope_freqs, Llama-3.1 style rope "
            "scaling), which the GGUF loader does not support; load the Hugging Face checkpoint instead."
        )
    scaling = _arch_key(gguf_file.metadata, arch, "rope.scaling.type")
    longrope = arch == "phi3" and "rope_factors_long.weight" in gguf_file.tensors
    yarn = arch in _YARN_ARCHS and scaling == "yarn"
    if scaling not in (None, "none", "linear") and not longrope and not yarn:
        raise ValueError(f"GGUF file {gguf_file.path!r}: rope scaling type {scaling!r} is not supported.")
    if arch == "deepseek2":
        _check_deepseek2(gguf_file)


def _check_deepseek2(gguf_file: GGUFFile) -> None:
    """DeepSeek-V3's routing only (sigmoid scores, a correction bias per expert): llama.cpp writes V2 and
    V2-Lite under the same architecture, with softmax gating (a file without ``expert_gating_func`` is one
    of those), which the DeepSeek model here does not implement."""
    meta, tensors = gguf_file.metadata, gguf_file.tensors
    if not int(meta.get("deepseek2.expert_count", 0) or 0):
        return
    gating = meta.get("deepseek2.expert_gating_func", _GATING_SOFTMAX)
    if gating != _GATING_SIGMOID:
        raise ValueError(
            f"GGUF file {gguf_file.path!r} is a DeepSeek-V2 style model (expert gating function {gating}, softmax); "
            "pagedllm loads deepseek2 GGUF files with DeepSeek-V3's sigmoid routing only (expert_gating_func 2)."
        )
    dense = int(meta.get("deepseek2.leading_dense_block_count", 0) or 0)
    n_layers = int(meta.get("deepseek2.block_count", 0) or 0)
    missing = [i for i in range(dense, n_layers) if f"blk.{i}.exp_probs_b.bias" not in tensors]
    if missing:
        raise ValueError(f"GGUF file {gguf_file.path!r}: sigmoid-routed layers {missing} lack their expert score "
                         "correction bias (blk.N.exp_probs_b.bias).")


def _tensor_values(gguf_file: GGUFFile, name: str) -> list[float]:
    """A small float32 tensor's values (rope factors)."""
    info = gguf_file.tensors[name]
    if info.ggml_type != 0:
        raise ValueError(f"GGUF file {gguf_file.path!r}: tensor {name!r} is not F32.")
    with open(gguf_file.path, "rb") as file:
        return _read_bytes(file, info.offset, info.nbytes).view(np.float32).tolist()


def _rope_parameters(gguf_file: GGUFFile, head_dim: int) -> dict[str, Any]:
    meta, arch = gguf_file.metadata, gguf_file.architecture
    theta = float(_arch_key(meta, arch, "rope.freq_base", 10000.0))
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    rotary_dim = int(_arch_key(meta, arch, "rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        params["partial_rotary_factor"] = rotary_dim / head_dim
    if _arch_key(meta, arch, "rope.scaling.type") == "linear":
        params.update(rope_type="linear", factor=float(_arch_key(meta, arch, "rope.scaling.factor", 1.0)))
    if "rope_factors_long.weight" in gguf_file.tensors:  # Phi-3's longrope
        params.update(
            rope_type="longrope",
            long_factor=_tensor_values(gguf_file, "rope_factors_long.weight"),
            short_factor=_tensor_values(gguf_file, "rope_factors_short.weight"),
            original_max_position_embeddings=int(_arch_key(meta, arch, "rope.scaling.original_context_length")),
        )
        attn_factor = _arch_key(meta, arch, "rope.scaling.attn_factor")
        if attn_factor is not None:
            params["attention_factor"] = float(attn_factor)
    if _arch_key(meta, arch, "rope.scaling.type") == "yarn":  # GPT-OSS, DeepSeek (check_gguf_supported)
        params.update(
            rope_type="yarn",
            factor=float(_arch_key(meta, arch, "rope.scaling.factor", 1.0)),
            original_max_position_embeddings=int(_arch_key(meta, arch, "rope.scaling.original_context_length")),
            beta_fast=float(_arch_key(meta, arch, "rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(_arch_key(meta, arch, "rope.scaling.yarn_beta_slow", 1.0)),
        )
        log_mul = _arch_key(meta, arch, "rope.scaling.yarn_log_multiplier")
        if log_mul:  # DeepSeek: 0.1 * mscale_all_dim, the softmax scale's yarn factor (mscale the same)
            mscale = round(float(log_mul) / 0.1, 6)  # the file holds it in float32
            params.update(mscale=mscale, mscale_all_dim=mscale)
        if arch == "gpt-oss":
            # The ramp's ends unrounded, as GPT-OSS's released config sets (llama.cpp rounds them).
            params["truncate"] = False
    return params


def _moe_settings(gguf_file: GGUFFile, model_type: str, n_expert: int, ffn: int) -> dict[str, Any]:
    """The config's mixture-of-experts keys. Sizes the metadata lacks are read off the first block's
    tensors. llama.cpp renormalizes the chosen experts' weights for Mixtral and Qwen3-MoE, not for
    Qwen2-MoE (a file's ``expert_weights_norm`` says otherwise where it is set)."""
    meta, arch, tensors = gguf_file.metadata, gguf_file.architecture, gguf_file.tensors
    used = _arch_key(meta, arch, "expert_used_count")
    gating = _arch_key(meta, arch, "expert_gating_func")
    if used is None or gating not in (None, 1):  # 1: llama.cpp's softmax gating
        raise ValueError(f"GGUF file {gguf_file.path!r}: a mixture of experts without {arch}.expert_used_count or "
                         f"with gating function {gating} (supported: softmax).")
    if model_type == _LLAMA_WITH_EXPERTS:  # Mixtral: experts of feed_forward_length, weights renormalized
        return {"num_local_experts": n_expert, "num_experts_per_tok": int(used)}

    def rows(name: str, default: int) -> int:
        info = tensors.get(f"blk.0.{name}.weight")
        return info.shape[-2] if info is not None else default

    settings: dict[str, Any] = {
        "num_experts": n_expert,
        "num_experts_per_tok": int(used),
        "moe_intermediate_size": int(_arch_key(meta, arch, "expert_feed_forward_length") or rows("ffn_gate_exps", ffn)),
        "norm_topk_prob": bool(_arch_key(meta, arch, "expert_weights_norm", arch != "qwen2moe")),
    }
    if arch == "qwen2moe":
        shared = _arch_key(meta, arch, "expert_shared_feed_forward_length") or rows("ffn_gate_shexp", ffn)
        settings["shared_expert_intermediate_size"] = int(shared)
    return settings


def gguf_to_hf_config(gguf_file: GGUFFile) -> Any:
    """The transformers config of the model the GGUF metadata describes (no tensor data is read
    but rope factors), with the settings llama.cpp fixes per architecture made explicit."""
    from transformers import AutoConfig

    from pagedllm.models.families import FAMILIES

    check_gguf_supported(gguf_file)
    meta = gguf_file.metadata
    arch = gguf_file.architecture
    try:
        hidden = int(_arch_key(meta, arch, "embedding_length"))
        n_head = int(_arch_key(meta, arch, "attention.head_count"))
        n_layers = int(_arch_key(meta, arch, "block_count"))
        ffn = int(_arch_key(meta, arch, "feed_forward_length"))
    except TypeError:
        raise ValueError(
            f"GGUF file {gguf_file.path!r} lacks required {arch}.* metadata "
            "(embedding_length, attention.head_count, block_count, feed_forward_length)."
        ) from None
    n_kv = int(_arch_key(meta, arch, "attention.head_count_kv", n_head))
    head_dim = int(_arch_key(meta, arch, "attention.key_length", hidden // n_head))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = int(_arch_key(meta, arch, "vocab_size", len(tokens) if tokens else 0))
    if not vocab_size:
        if "token_embd.weight" not in gguf_file.tensors:
            raise ValueError(f"GGUF file {gguf_file.path!r} has neither a vocabulary nor token_embd.weight.")
        vocab_size = gguf_file.tensors["token_embd.weight"].shape[0]
    n_expert = int(_arch_key(meta, arch, "expert_count", 0) or 0)
    model_type = _LLAMA_WITH_EXPERTS if arch == "llama" and n_expert else GGUF_MODEL_TYPES[arch]
    rope_parameters = _rope_parameters(gguf_file, head_dim)
    tensors = gguf_file.tensors
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=n_layers,
        num_attention_heads=n_head,
        max_position_embeddings=int(_arch_key(meta, arch, "context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        # DeepSeek-V3 has its own model class; every other family runs on the decoder.
        architectures=["DeepseekV3ForCausalLM" if arch == "deepseek2" else FAMILIES[model_type].architectures[0]],
    )
    if arch == "gptneox":
        kwargs.update(
            layer_norm_eps=float(_arch_key(meta, arch, "attention.layer_norm_epsilon", 1e-5)),
            use_parallel_residual=bool(_arch_key(meta, arch, "use_parallel_residual", True)),
            attention_bias="blk.0.attn_qkv.bias" in tensors,
        )
    else:
        kwargs.update(num_key_value_heads=n_kv, head_dim=head_dim)
        if arch in _LAYER_NORM_ARCHS:  # no rms_norm_eps: the decoder would read it first
            kwargs["layer_norm_eps"] = float(_arch_key(meta, arch, "attention.layer_norm_epsilon", 1e-5))
        else:
            kwargs["rms_norm_eps"] = float(_arch_key(meta, arch, "attention.layer_norm_rms_epsilon", 1e-6))
    if arch in ("llama", "qwen3", "qwen3moe"):
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "qwen2moe":
        kwargs["qkv_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "gpt-oss":
        kwargs.update(_gpt_oss_settings(gguf_file, n_layers, n_expert, ffn))
    elif arch == "deepseek2":
        for key in ("num_key_value_heads", "head_dim"):  # MLA: llama.cpp's are the latent's; the config derives its own
            kwargs.pop(key)
        kwargs.update(_deepseek2_settings(gguf_file, n_head, n_expert))
        rope_parameters = _rope_parameters(gguf_file, kwargs["qk_rope_head_dim"])
    elif n_expert:
        kwargs.update(_moe_settings(gguf_file, model_type, n_expert, ffn))
    window = _arch_key(meta, arch, "attention.sliding_window")
    if arch in ("gemma2", "gemma3"):
        # llama.cpp: 1/sqrt(hidden / heads) for the 27B models (46 / 62 layers), 1/sqrt(head_dim) otherwise.
        big = n_layers == (46 if arch == "gemma2" else 62)
        every = 2 if arch == "gemma2" else 6  # one global layer in every 2 (Gemma 2) / 6 (Gemma 3)
        kwargs.update(
            sliding_window=window,
            query_pre_attn_scalar=hidden // n_head if big else head_dim,
            layer_types=["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers)],
            attn_logit_softcapping=_arch_key(meta, arch, "attn_logit_softcapping"),
            final_logit_softcapping=_arch_key(meta, arch, "final_logit_softcapping"),
        )
        if arch == "gemma3":  # local layers keep llama.cpp's fixed base
            rope_parameters = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": rope_parameters}
    if arch == "phi3":
        kwargs["sliding_window"] = window or None
        if rope_parameters["rope_type"] == "longrope":
            kwargs["original_max_position_embeddings"] = rope_parameters["original_max_position_embeddings"]
    if arch in ("olmo2", "granite", "stablelm", "phi2", "command-r", "cohere2"):
        kwargs.update(_layout_settings(gguf_file, n_layers, head_dim))
        if arch == "olmo2" and window:  # OLMo 3: one rope setting per layer type, as its config keeps them
            model_type = "olmo3"
            kwargs["architectures"] = [FAMILIES[model_type].architectures[0]]
            rope_parameters = {"sliding_attention": rope_parameters, "full_attention": rope_parameters}
    return AutoConfig.for_model(model_type, rope_parameters=rope_parameters, **kwargs)


def _gpt_oss_settings(gguf_file: GGUFFile, n_layers: int, n_expert: int, ffn: int) -> dict[str, Any]:
    """GPT-OSS: biased q/k/v/o, sliding and full layers alternating (llama.cpp: even layers slide), experts
    ``expert_feed_forward_length`` wide with the clamped SwiGLU (llama.cpp's fixed limit of 7, or the file's
    ``swiglu_clamp_exp``, one value per layer)."""
    meta, arch = gguf_file.metadata, gguf_file.architecture
    used = _arch_key(meta, arch, "expert_used_count")
    window = _arch_key(meta, arch, "attention.sliding_window")
    if not n_expert or used is None or not window:
        raise ValueError(f"GGUF file {gguf_file.path!r}: a gpt-oss model needs {arch}.expert_count, "
                         f"{arch}.expert_used_count and {arch}.attention.sliding_window.")
    limits = _arch_key(meta, arch, "swiglu_clamp_exp")
    if isinstance(limits, list):
        if len(set(limits)) > 1:
            raise ValueError(f"GGUF file {gguf_file.path!r}: per-layer SwiGLU clamps {limits} (one for all layers "
                             "is supported).")
        limits = limits[0] if limits else None
    return {
        "num_local_experts": n_expert,
        "num_experts_per_tok": int(used),
        "intermediate_size": int(_arch_key(meta, arch, "expert_feed_forward_length") or ffn),
        "attention_bias": "blk.0.attn_q.bias" in gguf_file.tensors,
        "sliding_window": int(window),
        "layer_types": _sliding_layer_types(gguf_file, n_layers, 2),
        "swiglu_limit": float(limits) if limits else _GPT_OSS_SWIGLU_LIMIT,
    }


def _deepseek2_settings(gguf_file: GGUFFile, n_head: int, n_expert: int) -> dict[str, Any]:
    """DeepSeek-V3's latent attention and routed experts from llama.cpp's deepseek2 keys. Files written
    since llama.cpp's MLA converter give the per-head sizes as ``key_length_mla`` / ``value_length_mla``
    (``key_length`` / ``value_length`` then describe the latent); older ones give them as ``key_length`` /
    ``value_length``. Without ``expert_group_count`` every expert is eligible (one group), as llama.cpp
    routes such files. llama.cpp rotates channel pairs, DeepSeek's own layout: ``rope_interleave``."""
    meta, arch, tensors = gguf_file.metadata, gguf_file.architecture, gguf_file.tensors

    def key(name: str, default: Any = None) -> Any:
        return _arch_key(meta, arch, name, default)

    try:
        rope_dim = int(key("rope.dimension_count"))
        kv_lora = int(key("attention.kv_lora_rank"))
    except TypeError:
        raise ValueError(f"GGUF file {gguf_file.path!r} lacks {arch}.rope.dimension_count or "
                         f"{arch}.attention.kv_lora_rank.") from None
    qk_dim = int(key("attention.key_length_mla") or key("attention.key_length"))
    v_dim = int(key("attention.value_length_mla") or key("attention.value_length"))
    q_a = tensors.get("blk.0.attn_q_a.weight")
    q_lora = int(key("attention.q_lora_rank", 0) or q_a.shape[0]) if q_a is not None else None
    settings: dict[str, Any] = {
        "kv_lora_rank": kv_lora,
        "q_lora_rank": q_lora,
        "qk_nope_head_dim": qk_dim - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": v_dim,
        "num_key_value_heads": n_head,
        "rope_interleave": True,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_kv_a_mqa.bias" in tensors,
        "first_k_dense_replace": int(key("leading_dense_block_count", 0) or 0),
        "n_routed_experts": n_expert,
    }
    if n_expert:
        groups = int(key("expert_group_count", 1) or 1)
        settings.update(
            num_experts_per_tok=int(key("expert_used_count")),
            moe_intermediate_size=int(key("expert_feed_forward_length")),
            n_shared_experts=int(key("expert_shared_count", 0) or 0),
            routed_scaling_factor=float(key("expert_weights_scale", 1.0) or 1.0),
            norm_topk_prob=bool(key("expert_weights_norm", False)),
            n_group=groups,
            topk_group=int(key("expert_group_used_count", groups) or groups),
        )
    return settings


def _sliding_layer_types(gguf_file: GGUFFile, n_layers: int, every: int) -> list[str]:
    """Per layer, sliding or full attention: from ``attention.sliding_window_pattern`` (a flag per layer,
    or n: every n-th layer global, 0 none) or, without it, llama.cpp's fixed pattern ``every``."""
    pattern = _arch_key(gguf_file.metadata, gguf_file.architecture, "attention.sliding_window_pattern", every)
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise ValueError(f"GGUF file {gguf_file.path!r}: a sliding window pattern of {len(pattern)} layers "
                             f"for {n_layers}.")
        sliding = [bool(flag) for flag in pattern]
    else:
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(n_layers)]
    return ["sliding_attention" if flag else "full_attention" for flag in sliding]


def _layout_settings(gguf_file: GGUFFile, n_layers: int, head_dim: int) -> dict[str, Any]:
    """OLMo 2/3, Granite, StableLM, Phi-2, Command-R and Cohere 2: the config keys llama.cpp keeps as
    metadata (multipliers, windows) or only as the presence of tensors (biases, q/k norms, StableLM's
    parallel block)."""
    meta, arch, tensors = gguf_file.metadata, gguf_file.architecture, gguf_file.tensors
    kwargs: dict[str, Any] = {}
    if arch == "stablelm":
        kwargs.update(use_qkv_bias="blk.0.attn_q.bias" in tensors, qk_layernorm="blk.0.attn_q_norm.weight" in tensors,
                      use_parallel_residual="blk.0.ffn_norm.weight" not in tensors)
    elif arch != "phi2":  # Phi-2's biases are fixed
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "granite":  # llama.cpp's names for Granite's multipliers
        # Without attention.scale llama.cpp scales by 1/sqrt(head_dim); GraniteConfig's default would be 1.
        kwargs["attention_multiplier"] = head_dim**-0.5
        for key, setting in (("attention.scale", "attention_multiplier"), ("embedding_scale", "embedding_multiplier"),
                             ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling")):
            value = _arch_key(meta, arch, key)
            if value is not None:
                kwargs[setting] = float(value)
    if arch in ("command-r", "cohere2"):
        kwargs["logit_scale"] = float(_arch_key(meta, arch, "logit_scale", 1.0))
    if arch == "command-r":
        kwargs["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensors
    window = _arch_key(meta, arch, "attention.sliding_window")
    if arch in ("olmo2", "cohere2") and window:  # llama.cpp: three sliding layers, then a global one
        kwargs.update(sliding_window=int(window), layer_types=_sliding_layer_types(gguf_file, n_layers, 4))
    return kwargs


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixtures of experts: the router; the experts stacked ([n_expert, rows, cols]: iter_gguf_weights
    # yields each expert's matrix under mlp.experts.E.*); Qwen2-MoE's shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_OLMO2_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Where an architecture names a tensor differently (fused or plain MLPs, Gemma's four norms).
_ARCH_LAYER_NAMES = {
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    "gptneox": {"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
    "olmo2": _OLMO2_NAMES,
    "phi2": {"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
    "gpt-oss": {"post_attention_norm": "post_attention_layernorm"},
    # DeepSeek's latent attention; kv_b as one tensor (older files) or split per head into k_b and v_b,
    # which iter_gguf_weights joins back into kv_b_proj.
    "deepseek2": {
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",
        "attn_k_b": "self_attn.k_b_proj",
        "attn_v_b": "self_attn.v_b_proj",
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
    },
}
# Layer tensors named whole (with their suffix): GPT-OSS's sinks (one logit per head, which the decoder
# takes under ``self_attn.sinks``), DeepSeek-V3's routing bias.
_WHOLE_LAYER_NAMES = {
    "attn_sinks.weight": "self_attn.sinks",
    "attn_sinks": "self_attn.sinks",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def gguf_name_to_hf(name: str, arch: str = "llama") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ValueError if unknown."""
    if name.startswith("blk.") and name.count(".") >= 2:
        _, layer, whole = name.split(".", 2)
        if whole in _WHOLE_LAYER_NAMES and layer.isdigit():
            return f"model.layers.{layer}.{_WHOLE_LAYER_NAMES[whole]}"
    stem, _, suffix = name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
        if part in names and layer.isdigit():
            return f"model.layers.{layer}.{names[part]}.{suffix}"
    elif stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} has no counterpart in the {arch} model (unsupported variant?).")


def iter_gguf_weights(gguf_file: GGUFFile, packed: bool = True) -> Iterator[tuple[str, torch.Tensor | PackedTensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor, with q/k rows un-permuted.

    With ``packed``, 2-D tensors of the types in ``_PACKED_TYPES`` come as PackedTensor (the
    file's blocks, read once: no float copy); F32 / F16 / BF16 tensors come as
    float32; other quantized types are dequantized with a warning naming the tensor and type.
    Without ``packed`` every tensor is dequantized to float32 (the reference the packed path is
    tested against).
    """
    check_gguf_supported(gguf_file)
    meta = gguf_file.metadata
    arch = gguf_file.architecture
    n_head = int(_arch_key(meta, arch, "attention.head_count"))
    n_kv = int(_arch_key(meta, arch, "attention.head_count_kv", n_head))
    if arch not in _PERMUTED_ROPE:
        n_head = n_kv = 0  # nothing to un-permute
    weights = _gguf_tensors(gguf_file, map_file(gguf_file.path), packed, n_head, n_kv)
    yield from _joined_kv_b(weights) if arch == "deepseek2" else weights


def _joined_kv_b(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """llama.cpp's per-head halves of DeepSeek's kv_b_proj (``attn_k_b`` [heads, kv_lora_rank, nope], stored
    transposed for its absorbed attention, and ``attn_v_b`` [heads, v_head_dim, kv_lora_rank]) joined back
    into the one [heads * (nope + v_head_dim), kv_lora_rank] weight: per head its key rows, then its value
    rows."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        head, _, suffix = name.rpartition(".")
        stem, _, part = head.rpartition(".")
        if part not in ("k_b_proj", "v_b_proj") or suffix != "weight":
            yield name, tensor
            continue
        halves = pending.setdefault(stem, {})
        halves[part] = tensor
        if len(halves) == 2:
            del pending[stem]
            k_b, v_b = halves["k_b_proj"], halves["v_b_proj"]
            if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[:2] != (v_b.shape[0], v_b.shape[2]):
                raise ValueError(f"GGUF tensors of {stem}: k_b {tuple(k_b.shape)} and v_b {tuple(v_b.shape)} are not "
                                 "[heads, rank, nope] and [heads, v, rank].")
            joined = torch.cat((k_b.transpose(1, 2), v_b), dim=1)
            yield f"{stem}.kv_b_proj.weight", joined.reshape(-1, joined.shape[-1]).contiguous()
    if pending:
        raise ValueError(f"GGUF file: attn_k_b without attn_v_b (or the reverse) in {', '.join(sorted(pending))}.")


def _read_bytes(file: Any, offset: int, nbytes: int) -> np.ndarray:
    """A small tensor's bytes read into fresh memory (settings read before any weight is mapped)."""
    out = np.empty(nbytes, dtype=np.uint8)
    file.seek(offset)
    if file.readinto(memoryview(out)) != nbytes:
        raise ValueError(f"GGUF file {file.name!r} ended inside a tensor at byte {offset}.")
    return out


def _gguf_tensors(gguf_file: GGUFFile, data: np.ndarray, packed: bool, n_head: int,
                  n_kv: int) -> Iterator[tuple[str, torch.Tensor | PackedTensor]]:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    arch = gguf_file.architecture
    tensors = (part for info in gguf_file.tensors.values() if info.name not in _SETTING_TENSORS
               for part in _expert_matrices(info, gguf_name_to_hf(info.name, arch)))
    for hf_name, info in tensors:
        qtype = GGMLQuantizationType(info.ggml_type)
        raw = data[info.offset:info.offset + info.nbytes]
        fmt = _PACKED_TYPES.get(qtype.name)
        if packed and fmt is not None and len(info.shape) == 2:
            # The file's blocks where they lie (a view of the mapping), or q/k rows put back in order.
            rows = _unpermute(info.name, raw.reshape(info.shape[0], fmt.row_bytes(info.shape[1])), n_head, n_kv)
            yield hf_name, PackedTensor(as_tensor(np.ascontiguousarray(rows)), fmt, info.shape[1])
            continue
        if packed and qtype not in _FLOAT_TYPES and qtype.name not in _WARNED_TYPES:
            _WARNED_TYPES.add(qtype.name)
            logger.warning(
                "GGUF tensor %s is %s, which pagedllm does not keep packed (packed: %s); tensors of this type "
                "are dequantized to float at load time.", info.name, qtype.name, ", ".join(_PACKED_TYPES),
            )
        if qtype == GGMLQuantizationType.F32:
            w = np.array(raw).view(np.float32).reshape(info.shape)  # a copy: torch wants writable memory
        else:
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            rows = raw.reshape(*info.shape[:-1], info.shape[-1] // block_size * type_size)
            try:
                w = dequantize(np.asarray(rows), qtype)
            except NotImplementedError as e:
                raise ValueError(
                    f"GGUF file {gguf_file.path!r}: tensor {info.name!r} uses {qtype.name}, which the gguf package "
                    f"cannot dequantize ({e})."
                ) from None
            w = w.astype(np.float32, copy=False).reshape(info.shape)
        w = _unpermute(info.name, w, n_head, n_kv)
        if arch in _NORMS_PLUS_ONE and info.name.endswith("norm.weight"):
            w = w - 1.0
        if info.name.endswith("ffn_gate_inp_shexp.weight"):
            w = w.reshape(1, -1)  # llama.cpp's converter may store it 1-D; the layer is a [1, hidden] linear
        yield hf_name, torch.from_numpy(np.ascontiguousarray(w))


def _expert_matrices(info: GGUFTensorInfo, hf_name: str) -> Iterator[tuple[str, GGUFTensorInfo]]:
    """The tensor as it is, or for llama.cpp's stacked experts ([n_expert, rows, cols]; GPT-OSS's biases
    [n_expert, rows]) each expert's part under ``mlp.experts.E.*``: expert E is the E-th of n_expert
    equal byte ranges (whole rows of blocks), read as a tensor of its own, so a quantized expert is
    loaded packed as any linear's weight is, without a copy of the whole stack."""
    stacked = len(info.shape) == 3 or (len(info.shape) == 2 and hf_name.endswith(".bias"))
    if not stacked or ".experts." not in hf_name:
        yield hf_name, info
        return
    n_expert = info.shape[0]
    size = info.nbytes // n_expert
    for e in range(n_expert):
        part = GGUFTensorInfo(info.name, info.shape[1:], info.ggml_type, info.offset + e * size, size)
        yield hf_name.replace(".experts.", f".experts.{e}.", 1), part


def _unpermute(name: str, w: np.ndarray, n_head: int, n_kv: int) -> np.ndarray:
    """q/k rows back in HF's order where llama.cpp permuted them (n_head 0: it did not)."""
    if n_head and ".attn_q." in name:
        return _unpermute_rope_rows(w, n_head)
    if n_kv and ".attn_k." in name:
        return _unpermute_rope_rows(w, n_kv)
    return w
