"""Tiny random Llama models written as GGUF files of each packed type, for the quantized-weight tests.

gguf-py quantizes the legacy types (Q4_0, Q4_1, Q8_0) from float; K-quant blocks (Q4_K, Q5_K,
Q6_K) are written directly: random quants and sub-block scales, with the fp16 super-block scales
chosen so the weights have a small spread, as a trained model's do.
"""

from __future__ import annotations

import numpy as np

HIDDEN = 256
FFN = 512
LAYERS = 2
HEADS = 4
KV_HEADS = 2
# Q4_K_M's mix: Q4_K for most tensors, Q6_K for attn_v, ffn_down and the output projection.
Q4_K_M = {"default": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"}


def _half_bytes(rng: np.random.Generator, shape: tuple[int, ...], low: float, high: float) -> np.ndarray:
    return rng.uniform(low, high, size=shape).astype(np.float16).view(np.uint8).reshape(*shape, 2)


def random_kquant(rng: np.random.Generator, type_name: str, rows: int, cols: int) -> np.ndarray:
    """Random valid blocks of a K-quant type: uint8 ``[rows, row_bytes]``."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    blocks = rng.integers(0, 256, size=(rows, cols // block_values, block_bytes), dtype=np.uint8)
    lead = blocks.shape[:-1]
    if type_name in ("Q4_K", "Q5_K"):
        blocks[..., 0:2] = _half_bytes(rng, lead, 2e-5, 6e-5)  # d: sub-block scales reach 63 * d
        blocks[..., 2:4] = _half_bytes(rng, lead, 2e-5, 6e-5)  # dmin
    elif type_name == "Q6_K":
        blocks[..., 192:208] = rng.integers(-32, 32, size=(*lead, 16)).astype(np.int8).view(np.uint8)
        blocks[..., 208:210] = _half_bytes(rng, lead, 2e-5, 6e-5)
    else:
        raise ValueError(type_name)
    return blocks.reshape(rows, -1)


def _tensor_bytes(rng: np.random.Generator, type_name: str, rows: int, cols: int):
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    if type_name in ("Q4_K", "Q5_K", "Q6_K"):
        return random_kquant(rng, type_name, rows, cols), GGMLQuantizationType[type_name]
    weights = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    if type_name == "F32":
        return weights, None
    qtype = GGMLQuantizationType[type_name]
    return quantize(weights, qtype), qtype


def write_tiny_llama_gguf(path: str, types: str | dict[str, str], vocab_size: int, seed: int = 0,
                          tied: bool = False, hidden: int = HIDDEN, ffn: int = FFN) -> str:
    """A random Llama (2 layers) whose linear / embedding tensors have the given GGUF types.

    ``types``: one type name for all, or a map from tensor kind (``attn_q``, ``ffn_down``,
    ``token_embd``, ``output``, ...) to type, with ``"default"`` for the rest.
    """
    import gguf

    kinds = {"default": types} if isinstance(types, str) else dict(types)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab_size)
    writer.add_eos_token_id(2)
    writer.add_bos_token_id(1)
    head_dim = hidden // HEADS

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        data, qtype = _tensor_bytes(rng, kinds.get(kind, kinds["default"]), rows, cols)
        writer.add_tensor(name, data, raw_dtype=qtype)

    def add_norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))

    add("token_embd.weight", "token_embd", vocab_size, hidden)
    for i in range(LAYERS):
        add_norm(f"blk.{i}.attn_norm.weight")
        add(f"blk.{i}.attn_q.weight", "attn_q", HEADS * head_dim, hidden)
        add(f"blk.{i}.attn_k.weight", "attn_k", KV_HEADS * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", "attn_v", KV_HEADS * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", "attn_output", hidden, HEADS * head_dim)
        add_norm(f"blk.{i}.ffn_norm.weight")
        add(f"blk.{i}.ffn_gate.weight", "ffn_gate", ffn, hidden)
        add(f"blk.{i}.ffn_up.weight", "ffn_up", ffn, hidden)
        add(f"blk.{i}.ffn_down.weight", "ffn_down", hidden, ffn)
    add_norm("output_norm.weight")
    if not tied:
        add("output.weight", "output", vocab_size, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
