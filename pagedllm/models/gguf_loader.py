"""GGUF files: metadata, a transformers config built from it, and dequantized weights under HF names.

The header is parsed here with ``struct`` over an mmap rather than with ``gguf.GGUFReader``: the
reader builds a numpy view per metadata element, which takes seconds on a 49k-token vocabulary,
while this walk takes milliseconds. Tensor data is dequantized with ``gguf.quants.dequantize``.
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

from pagedllm.quantization.formats import GGUF_PACKED_TYPES
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
}
SUPPORTED_GGUF_ARCHITECTURES = tuple(GGUF_MODEL_TYPES)
# llama.cpp stores Gemma's norm weights with the 1 of ``1 + weight`` added.
_NORMS_PLUS_ONE = ("gemma2", "gemma3")
# Only llama.cpp's Llama permutes q/k rows for its interleaved rope; the others use halves as HF does.
_PERMUTED_ROPE = ("llama",)
# Tensors that hold settings, read into the config rather than loaded as weights.
_SETTING_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_FLOAT_TYPES = {0, 1, 30}  # F32, F16, BF16: loaded as float tensors
_WARNED_TYPES: set[str] = set()

# Metadata value types of the GGUF spec -> struct format of the fixed-size ones.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_TYPE_STRING = 8
_TYPE_ARRAY = 9
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
            return [self.value(item_type) for _ in range(count)]
        raise self.fail(f"unknown metadata value type {value_type}")


def read_gguf(path: str) -> GGUFFile:
    """Parse the header of a GGUF file (metadata and tensor table); validate tensor extents."""
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
    if scaling not in (None, "none", "linear") and not longrope:
        raise ValueError(f"GGUF file {gguf_file.path!r}: rope scaling type {scaling!r} is not supported.")


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
    return params


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
    model_type = GGUF_MODEL_TYPES[arch]
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
        architectures=[FAMILIES[model_type].architectures[0]],
    )
    if arch == "gptneox":
        kwargs.update(
            layer_norm_eps=float(_arch_key(meta, arch, "attention.layer_norm_epsilon", 1e-5)),
            use_parallel_residual=bool(_arch_key(meta, arch, "use_parallel_residual", True)),
            attention_bias="blk.0.attn_qkv.bias" in tensors,
        )
    else:
        kwargs.update(
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=float(_arch_key(meta, arch, "attention.layer_norm_rms_epsilon", 1e-6)),
        )
    if arch in ("llama", "qwen3"):
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
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
    return AutoConfig.for_model(model_type, rope_parameters=rope_parameters, **kwargs)


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
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def gguf_name_to_hf(name: str, arch: str = "llama") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ValueError if unknown."""
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

    With ``packed``, 2-D tensors of the types in ``GGUF_PACKED_TYPES`` come as PackedTensor (the
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
    data = np.memmap(gguf_file.path, dtype=np.uint8, mode="r")
    with open(gguf_file.path, "rb") as file:
        yield from _gguf_tensors(gguf_file, data, file, packed, n_head, n_kv)


def _read_bytes(file: Any, offset: int, nbytes: int) -> np.ndarray:
    """A tensor's bytes read into fresh memory. Unlike slicing the mapping, this leaves no file pages
    in the process's resident set (which would count the model twice while it loads)."""
    out = np.empty(nbytes, dtype=np.uint8)
    file.seek(offset)
    if file.readinto(memoryview(out)) != nbytes:
        raise ValueError(f"GGUF file {file.name!r} ended inside a tensor at byte {offset}.")
    return out


def _gguf_tensors(gguf_file: GGUFFile, data: np.ndarray, file: Any, packed: bool, n_head: int,
                  n_kv: int) -> Iterator[tuple[str, torch.Tensor | PackedTensor]]:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    arch = gguf_file.architecture
    for info in gguf_file.tensors.values():
        if info.name in _SETTING_TENSORS:
            continue
        hf_name = gguf_name_to_hf(info.name, arch)
        qtype = GGMLQuantizationType(info.ggml_type)
        raw = data[info.offset:info.offset + info.nbytes]
        fmt = GGUF_PACKED_TYPES.get(qtype.name)
        if packed and fmt is not None and len(info.shape) == 2:
            rows = _read_bytes(file, info.offset, info.nbytes).reshape(info.shape[0], fmt.row_bytes(info.shape[1]))
            rows = _unpermute(info.name, rows, n_head, n_kv)
            yield hf_name, PackedTensor(torch.from_numpy(np.ascontiguousarray(rows)), fmt, info.shape[1])
            continue
        if packed and qtype not in _FLOAT_TYPES and qtype.name not in _WARNED_TYPES:
            _WARNED_TYPES.add(qtype.name)
            logger.warning(
                "GGUF tensor %s is %s, which pagedllm does not keep packed (packed: %s); tensors of this type "
                "are dequantized to float at load time.", info.name, qtype.name, ", ".join(GGUF_PACKED_TYPES),
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
        yield hf_name, torch.from_numpy(np.ascontiguousarray(w))


def _unpermute(name: str, w: np.ndarray, n_head: int, n_kv: int) -> np.ndarray:
    """q/k rows back in HF's order where llama.cpp permuted them (n_head 0: it did not)."""
    if n_head and ".attn_q." in name:
        return _unpermute_rope_rows(w, n_head)
    if n_kv and ".attn_k." in name:
        return _unpermute_rope_rows(w, n_kv)
    return w
