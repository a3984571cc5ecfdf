"""The ``kv_cache_dtype`` setting parsed once into a KVCacheFormat: what a KV row holds and its bytes.

One object serves every reader of the setting: the pool (its storage dtype and row width), the
attention backend (``cache_format`` maps a pool's dtype back to its format), the simulator's model
shapes (bytes per token, with no torch import) and the metrics (the name and the bytes). Names are
vLLM's; "fp8" is "fp8_e4m3". How each format quantizes is in attention/kv_quant.py.

Row layouts (one token, one KV head, K or V): "auto" keeps ``head_dim`` values in the model dtype;
"bfloat16" and "float16" keep ``head_dim`` values in that 16-bit type whatever the model computes in
(a float32 model then stores half the bytes, as llama.cpp's default f16 cache does); int8 and fp8
store ``head_dim`` one-byte values and a float16 scale; int4 stores two values a byte and, per group
of ``INT4_GROUP`` values, a float16 scale and a float16 minimum.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
INT4_GROUP = 32
_SCALE_BYTES = 2  # a float16 scale: values are quantized against it as stored
_INT4_GROUP_BYTES = 4  # a float16 scale and a float16 minimum


@dataclass(frozen=True, slots=True)
class KVCacheFormat:
    """How the KV cache stores a row; ``storage`` is the pool's torch dtype by name (None: the model's).
    The 16-bit float formats store plain values (no scales, no rotation); the 8- and 4-bit ones are
    quantized."""

    name: str
    storage: str | None = None
    bits: int = 0
    max_value: float = 0.0  # the largest |x / scale| stored (int8, fp8); unused for int4 and "auto"

    @property
    def quantized(self) -> bool:
        return self.storage is not None and self.bits < 16

    def value_bytes(self, model_dtype_bytes: int) -> int:
        """Bytes of one stored value of a float format: the model dtype's for "auto"."""
        if self.quantized:
            raise ValueError(f"kv_cache_dtype={self.name!r} stores quantized rows, not one value per element")
        return self.bits // 8 if self.storage is not None else model_dtype_bytes

    @property
    def integer_grid(self) -> bool:
        """Values on an evenly spaced grid (int8, int4): one step for a whole row or group, so a bias
        the keys share widens every value's step (attention/key_offset.py takes it out). A float8
        value's step follows its own magnitude instead."""
        return self.storage in ("int8", "uint8")

    def check_head_dim(self, head_dim: int) -> None:
        if self.bits == 4 and head_dim % INT4_GROUP:
            raise ValueError(
                f"kv_cache_dtype='int4' needs a head size that is a multiple of {INT4_GROUP}, this model's is "
                f"{head_dim}; use 'int8' or 'fp8'."
            )

    def pool_row(self, head_dim: int) -> int:
        """The last axis of a pool: ``head_dim`` float values, or a quantized row's bytes."""
        return self.row_bytes(head_dim) if self.quantized else head_dim

    def row_bytes(self, head_dim: int, model_dtype_bytes: int | None = None) -> int:
        """Bytes of one (token, KV head) row, scales included; "auto" needs the model dtype's size."""
        if not self.quantized:
            if self.storage is None and model_dtype_bytes is None:
                raise ValueError("the bytes of an 'auto' KV row depend on the model dtype: pass model_dtype_bytes")
            return head_dim * self.value_bytes(model_dtype_bytes or 0)
        if self.bits == 4:
            return head_dim // 2 + head_dim // INT4_GROUP * _INT4_GROUP_BYTES
        return head_dim + _SCALE_BYTES

    def bytes_per_token(self, head_dim: int, num_kv_heads: int, num_layers: int, model_dtype_bytes: int) -> int:
        """K and V of one token over all layers."""
        return 2 * num_layers * num_kv_heads * self.row_bytes(head_dim, model_dtype_bytes)

    def __str__(self) -> str:
        return self.name


AUTO = KVCacheFormat("auto")
FORMATS: dict[str, KVCacheFormat] = {
    "auto": AUTO,
    "bfloat16": KVCacheFormat("bfloat16", "bfloat16", 16),
    "float16": KVCacheFormat("float16", "float16", 16),
    "int8": KVCacheFormat("int8", "int8", 8, 127.0),
    "fp8_e4m3": KVCacheFormat("fp8_e4m3", "float8_e4m3fn", 8, 448.0),
    "fp8_e5m2": KVCacheFormat("fp8_e5m2", "float8_e5m2", 8, 57344.0),
    "int4": KVCacheFormat("int4", "uint8", 4, 15.0),
}


def parse_kv_cache_dtype(setting: str | KVCacheFormat) -> KVCacheFormat:
    """The format a ``kv_cache_dtype`` setting names ("fp8" -> fp8_e4m3), or a ValueError."""
    if isinstance(setting, KVCacheFormat):
        return setting
    if setting not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {setting!r}.")
    return FORMATS["fp8_e4m3" if setting == "fp8" else setting]
