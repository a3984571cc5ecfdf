"""Write random-weight Llama-shaped GGUF models for the quantized benchmarks (issue 11).

    .venv/bin/python benchmarks/make_gguf_models.py --models 1b --types q4_0 q4_k_m     # ~0.7 + 0.8 GB
    .venv/bin/python benchmarks/make_gguf_models.py --models 8b --types q4_k_m          # ~4.9 GB
    .venv/bin/python benchmarks/make_gguf_models.py --check                             # verify the blocks only

Files land in --out-dir (default /work/models) as ``llama-3.2-1b-random.Q4_0.gguf`` etc.; an
existing file is kept unless --force. Shapes are those of Llama-3.2-1B (hidden 2048, 16 layers,
32 heads / 8 KV heads, ffn 8192, tied embeddings, rope theta 500000) and Llama-3-8B (hidden 4096,
32 layers, 32 / 8 heads, ffn 14336, untied), both with vocab 128256. Left out, as they change no
speed figure: Llama-3.1-style rope scaling (the rope_freqs tensor pagedllm refuses) and a real
context length (8192 here).

Tensor types follow llama.cpp's ``llama-quantize`` defaults (llama-quant.cpp):
- Q4_0: every 2-D weight Q4_0, except the output matrix — ``output.weight``, or the tied
  ``token_embd.weight`` when there is none — in Q6_K. ``--pure`` makes that one Q4_0 too.
- Q4_K_M: Q4_K everywhere except Q6_K for the output matrix, and for ``attn_v`` and ``ffn_down``
  of the layers ``use_more_bits`` picks (the first and last eighth, and every third between:
  about half).
Norm weights are F32 near 1. Weights are random (~N(0, 0.02)-sized): outputs are meaningless
tokens, which is all a speed figure needs (run with ignore_eos / fixed output lengths).

The file is written tensor by tensor: every tensor's info goes into the header first, then each
tensor is generated packed, written and dropped, so memory peaks at the largest packed tensor
(the 8B's Q6_K output matrix, ~430 MB), never a float32 copy of the model.

Tokenizer: the embedded default model's (SmolLM2, GPT-2 BPE, 49152 tokens), copied key by key and
padded to the model's vocabulary with ``<|extra_N|>`` tokens of type UNUSED (5): llama.cpp sizes the
embedding from the token list, so the list must be as long as the vocabulary; UNUSED keeps the pad
out of transformers' added tokens (pagedllm's tokenizer) and out of llama.cpp's special-token
matching. Random prompt ids should stay below 49152 so they detokenize to real text.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_VERSION, GGMLQuantizationType, LlamaFileType, TokenType

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

from gguf_blocks import check_blocks, random_packed, row_bytes  # noqa: E402

Q = GGMLQuantizationType
DEFAULT_OUT_DIR = "/work/models"


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    rope_theta: float
    rms_eps: float = 1e-5
    context: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "1b": Shape("llama-3.2-1b-random", hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256,
                tied=True, rope_theta=500000.0),
    "8b": Shape("llama-3-8b-random", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                tied=False, rope_theta=500000.0),
}
FILE_TYPES = {"q4_0": LlamaFileType.MOSTLY_Q4_0, "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in the _M mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_plan(shape: Shape, kind: str, pure: bool) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """(GGUF name, numpy shape (out, in), type) of every tensor, in file order."""
    base = Q.Q4_0 if kind == "q4_0" else Q.Q4_K
    output_type = base if pure else Q.Q6_K
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim

    def more_bits(i: int) -> GGMLQuantizationType:
        return Q.Q6_K if kind == "q4_k_m" and use_more_bits(i, shape.layers) else base

    plan = [("token_embd.weight", (shape.vocab, h), output_type if shape.tied else base)]
    for i in range(shape.layers):
        plan += [
            (f"blk.{i}.attn_norm.weight", (h,), Q.F32),
            (f"blk.{i}.attn_q.weight", (h, h), base),
            (f"blk.{i}.attn_k.weight", (kv, h), base),
            (f"blk.{i}.attn_v.weight", (kv, h), more_bits(i)),
            (f"blk.{i}.attn_output.weight", (h, h), base),
            (f"blk.{i}.ffn_norm.weight", (h,), Q.F32),
            (f"blk.{i}.ffn_gate.weight", (shape.ffn, h), base),
            (f"blk.{i}.ffn_up.weight", (shape.ffn, h), base),
            (f"blk.{i}.ffn_down.weight", (h, shape.ffn), more_bits(i)),
        ]
    plan.append(("output_norm.weight", (h,), Q.F32))
    if not shape.tied:
        plan.append(("output.weight", (shape.vocab, h), output_type))
    return plan


def packed_nbytes(dims: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    if qtype == Q.F32:
        return 4 * int(np.prod(dims))
    return int(np.prod(dims[:-1])) * row_bytes(qtype, dims[-1])


def add_tokenizer(writer: GGUFWriter, vocab: int) -> None:
    """The default model's tokenizer metadata, its token list padded to ``vocab`` with UNUSED tokens."""
    from pagedllm.models.gguf_loader import read_gguf
    from pagedllm.models.loader import default_model_path

    meta = read_gguf(default_model_path()).metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    if vocab < len(tokens):
        raise ValueError(f"vocab {vocab} is smaller than the default tokenizer's {len(tokens)} tokens")
    pad = vocab - len(tokens)
    tokens += [f"<|extra_{n}|>" for n in range(pad)]
    types += [int(TokenType.UNUSED)] * pad
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(meta["tokenizer.ggml.merges"]))
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("unknown_token_id", writer.add_unk_token_id), ("padding_token_id", writer.add_pad_token_id)):
        if f"tokenizer.ggml.{key}" in meta:
            add(int(meta[f"tokenizer.ggml.{key}"]))
    if "tokenizer.ggml.add_bos_token" in meta:
        writer.add_add_bos_token(bool(meta["tokenizer.ggml.add_bos_token"]))
    if "tokenizer.ggml.add_space_prefix" in meta:
        writer.add_add_space_prefix(bool(meta["tokenizer.ggml.add_space_prefix"]))
    if "tokenizer.chat_template" in meta:
        writer.add_chat_template(str(meta["tokenizer.chat_template"]))


def write_model(path: str, shape: Shape, kind: str, pure: bool, seed: int) -> None:
    plan = tensor_plan(shape, kind, pure)
    tmp = path + ".partial"
    writer = GGUFWriter(tmp, "llama")
    writer.add_name(f"{shape.name} ({kind.upper()}{', pure' if pure else ''}, random weights)")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(int(FILE_TYPES[kind]))
    writer.add_quantization_version(GGML_QUANT_VERSION)
    add_tokenizer(writer, shape.vocab)
    for name, dims, qtype in plan:
        if qtype == Q.F32:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), packed_nbytes(dims, qtype))
        else:  # uint8 byte shape + raw type: gguf-py turns the byte shape back into the element shape
            byte_shape = (*dims[:-1], row_bytes(qtype, dims[-1]))
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), packed_nbytes(dims, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    start, written, total = time.perf_counter(), 0, sum(packed_nbytes(d, t) for _, d, t in plan)
    for index, (name, dims, qtype) in enumerate(plan):
        rng = np.random.default_rng([seed, index])  # per tensor: the same weights whatever is skipped
        if qtype == Q.F32:  # norms: near 1, as trained RMSNorm gains are
            data = (1.0 + 0.05 * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)
        else:
            data = random_packed(rng, qtype, int(np.prod(dims[:-1])), dims[-1])
        writer.write_tensor_data(data)
        written += data.nbytes
        del data
        if index % 20 == 0 or index == len(plan) - 1:
            print(f"  {written / 2**30:6.2f} / {total / 2**30:.2f} GiB  {name}  "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    writer.close()
    os.replace(tmp, path)


def model_path(out_dir: str, model: str, kind: str, pure: bool) -> str:
    suffix = {"q4_0": "Q4_0", "q4_k_m": "Q4_K_M"}[kind] + ("-pure" if pure else "")
    return os.path.join(out_dir, f"{SHAPES[model].name}.{suffix}.gguf")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=["1b"])
    parser.add_argument("--types", nargs="+", choices=sorted(FILE_TYPES), default=["q4_0", "q4_k_m"])
    parser.add_argument("--pure", action="store_true", help="the output matrix in the base type too")
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rewrite files that exist")
    parser.add_argument("--check", action="store_true", help="only verify the random blocks against gguf-py")
    args = parser.parse_args(argv)
    for name, (mean, spread) in check_blocks(args.seed).items():
        print(f"block check {name}: dequantized mean {mean:+.1e}, std {spread:.4f} (target 0.02)")
    if args.check:
        return 0
    os.makedirs(args.out_dir, exist_ok=True)
    for model in args.models:
        for kind in args.types:
            path = model_path(args.out_dir, model, kind, args.pure)
            if os.path.exists(path) and not args.force:
                print(f"{path} exists (--force rewrites it)")
                continue
            plan = tensor_plan(SHAPES[model], kind, args.pure)
            need = sum(packed_nbytes(d, t) for _, d, t in plan)
            free = os.statvfs(args.out_dir).f_bavail * os.statvfs(args.out_dir).f_frsize
            if need * 1.05 > free:
                raise SystemExit(f"{path} needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
            print(f"writing {path} ({need / 2**30:.2f} GiB of tensors)", flush=True)
            start = time.perf_counter()
            write_model(path, SHAPES[model], kind, args.pure, args.seed)
            print(f"wrote {path}: {os.path.getsize(path) / 2**30:.2f} GiB in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
