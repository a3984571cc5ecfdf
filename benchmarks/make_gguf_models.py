"""Write random-weight GGUF models of real models' shapes for the quantized benchmarks (issue 11).

    .venv/bin/python benchmarks/make_gguf_models.py --models 1b --types q4_0 q4_k_m     # ~0.7 + 0.8 GB
    .venv/bin/python benchmarks/make_gguf_models.py --models 8b --types q4_k_m          # ~4.9 GB
    .venv/bin/python benchmarks/make_gguf_models.py --models qwen3-4b olmo-2-1b --types q4_k_m q8_0
    .venv/bin/python benchmarks/make_gguf_models.py --models gpt-oss-20b --types mxfp4  # ~12.1 GB
    .venv/bin/python benchmarks/make_gguf_models.py --models zoo --types all            # every new shape, ~44 GB
    .venv/bin/python benchmarks/make_gguf_models.py --models zoo --types all --tiny --out-dir /work/models/tiny
    .venv/bin/python benchmarks/make_gguf_models.py --check                             # verify the blocks only

Files land in --out-dir (default /work/models) as ``llama-3.2-1b-random.Q4_0.gguf``,
``qwen3-4b-random.Q4_K_M.gguf``, ``gpt-oss-20b-random.MXFP4.gguf`` etc. (``--tiny``:
``qwen3-4b-tiny-random.Q8_0.gguf``: the same architecture and tensor layout, 2 layers, hidden 256:
zoo_shapes.tiny); an existing file is kept unless --force; each file's size is printed before it
is written, and a file the disk has no room for is refused.

Shapes (zoo_shapes.SHAPES: the real models' config.json values, and which of them are unsure):
``1b`` Llama-3.2-1B and ``8b`` Llama-3-8B (arch "llama", context 8192, no Llama-3.1 rope
scaling: the rope_freqs tensor pagedllm refuses), ``llama-3.2-3b``, ``qwen3-4b`` ("qwen3"),
``gemma-3-4b`` text only ("gemma3"), ``phi-3.5-mini`` ("phi3"), ``olmo-2-1b`` ("olmo2"),
``granite-3.3-2b`` ("granite"), ``gpt-oss-20b`` ("gpt-oss"); ``--models zoo`` is the seven new ones,
``all`` every one. Tensor names, shapes and metadata keys are those llama.cpp's converter writes
for each architecture (zoo_shapes.layer_tensors / add_arch_metadata).

Tensor types follow llama.cpp's ``llama-quantize`` (llama-quant.cpp); norms, biases, GPT-OSS's
sinks and routers (``ffn_gate_inp``) and Phi-3's rope factors stay F32:
- Q4_0: every matrix Q4_0, except the output matrix — ``output.weight``, or the tied
  ``token_embd.weight`` when there is none — in Q6_K. ``--pure`` makes that one Q4_0 too.
- Q4_K_M: Q4_K everywhere except Q6_K for the output matrix, and for ``attn_v`` and ``ffn_down``
  of the layers ``use_more_bits`` picks (the first and last eighth, and every third between:
  about half), and Q5_K for a fused ``attn_qkv`` (Phi-3).
- Q8_0: every matrix Q8_0, the output matrix included.
- MXFP4 (GPT-OSS only, which ships only so: llama.cpp's MXFP4_MOE): the 3-D expert stacks
  ``ffn_{gate,up,down}_exps`` MXFP4, every other matrix (embedding, output, attention) Q8_0. Q8_0
  rather than F16 / BF16 because it is what ``llama-quantize ... MXFP4_MOE`` gives and what
  ggml-org's gpt-oss-20b-mxfp4.gguf holds: its 12.1 GB is the MXFP4 experts (~10.2 GB) plus the
  other 1.8 B weights at Q8_0's 8.5 bits (F16 would make it ~13.8 GB); this writer's file is
  12.10 GB (11.27 GiB). GPT-OSS's 2880-wide rows are not whole 256-value K-quant blocks, so
  the K-quant mixes do not apply to it; MXFP4 is refused for the dense shapes (it would be Q8_0).
Weights are random (~N(0, 0.02)-sized), norms near 1: outputs are meaningless tokens, which is
all a speed figure needs (run with ignore_eos / fixed output lengths).

The file is written tensor by tensor: every tensor's info goes into the header first, then each
tensor is generated packed, written and dropped, so memory peaks at the largest packed tensor
(gpt-oss-20b's Q8_0 output matrix, ~615 MB), never a float32 copy of the model.

Tokenizer: the embedded default model's (SmolLM2, GPT-2 BPE, 49152 tokens), copied key by key and
padded to the model's vocabulary with ``<|extra_N|>`` tokens of type UNUSED (5): llama.cpp sizes the
embedding from the token list, so the list must be as long as the vocabulary; UNUSED keeps the pad
out of transformers' added tokens (pagedllm's tokenizer) and out of llama.cpp's special-token
matching. A smaller vocabulary (Phi-3's 32064) cuts the list, and drops the merges whose parts or
result were cut. Random prompt ids should stay below min(vocab, 49152) so they detokenize to real text.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_VERSION, GGMLQuantizationType, LlamaFileType, TokenType

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

from gguf_blocks import check_blocks, random_packed, row_bytes  # noqa: E402
from zoo_shapes import FLOAT_ROLES, SHAPES, Shape, add_arch_metadata, float_values, model_tensors, tiny  # noqa: E402

Q = GGMLQuantizationType
DEFAULT_OUT_DIR = "/work/models"


FILE_TYPES = {"q4_0": LlamaFileType.MOSTLY_Q4_0, "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M,
              "q8_0": LlamaFileType.MOSTLY_Q8_0, "mxfp4": LlamaFileType.MOSTLY_MXFP4_MOE}
FILE_SUFFIXES = {"q4_0": "Q4_0", "q4_k_m": "Q4_K_M", "q8_0": "Q8_0", "mxfp4": "MXFP4"}
# The new zoo (``--models zoo``; ``all`` adds the 1B and 8B Llamas).
ZOO = ("llama-3.2-3b", "qwen3-4b", "gemma-3-4b", "phi-3.5-mini", "olmo-2-1b", "granite-3.3-2b", "gpt-oss-20b")


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in the _M mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def applicable(shape: Shape, kind: str) -> str | None:
    """Why ``shape`` is not written as ``kind`` (None: it is). A mixture ships as MXFP4 experts (llama.cpp's
    MXFP4_MOE); MXFP4 is for mixtures only; K-quants need rows of whole 256-value blocks."""
    if shape.experts and kind != "mxfp4":
        return f"{shape.name} is written as llama.cpp ships it: --types mxfp4"
    if kind == "mxfp4" and not shape.experts:
        return f"{shape.name} has no experts: mxfp4 is for mixtures (use q8_0)"
    widths = {dims[-1] for _, dims, role in model_tensors(shape) if role not in FLOAT_ROLES}
    block = 256 if kind == "q4_k_m" else 32
    if any(w % block for w in widths):
        return f"{shape.name}: rows of {sorted(widths)} are not whole {kind} blocks of {block}"
    return None


def tensor_plan(shape: Shape, kind: str, pure: bool) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """(GGUF name, numpy shape (out, in) or (n_expert, out, in), type) of every tensor, in file order.

    llama-quantize's choices (llama-quant.cpp): 1-D tensors, norms, routers, biases and sinks stay F32;
    the output matrix (or the tied embedding) Q6_K in Q4_0 / Q4_K_M (``pure``: the base type), Q8_0 in
    Q8_0 and MXFP4_MOE; Q4_K_M's attn_v / ffn_down Q6_K in the ``use_more_bits`` layers and its fused
    attn_qkv Q5_K; MXFP4_MOE: the 3-D expert stacks MXFP4, every other matrix Q8_0."""
    base = {"q4_0": Q.Q4_0, "q4_k_m": Q.Q4_K, "q8_0": Q.Q8_0, "mxfp4": Q.Q8_0}[kind]
    output_type = base if pure or kind in ("q8_0", "mxfp4") else Q.Q6_K

    def qtype(name: str, role: str) -> GGMLQuantizationType:
        if role in FLOAT_ROLES:
            return Q.F32
        if role == "output" or (role == "embd" and shape.tied):
            return output_type
        if role in ("experts", "ffn_down_exps") and kind == "mxfp4":
            return Q.MXFP4
        if kind == "q4_k_m" and role == "attn_qkv":
            return Q.Q5_K
        if kind == "q4_k_m" and role in ("attn_v", "ffn_down", "ffn_down_exps"):
            return Q.Q6_K if use_more_bits(int(name.split(".")[1]), shape.layers) else base
        return base

    return [(name, dims, qtype(name, role)) for name, dims, role in model_tensors(shape)]


def packed_nbytes(dims: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    if qtype == Q.F32:
        return 4 * int(np.prod(dims))
    return int(np.prod(dims[:-1])) * row_bytes(qtype, dims[-1])


def add_tokenizer(writer: GGUFWriter, vocab: int) -> None:
    """The default model's tokenizer metadata, its token list padded to ``vocab`` with UNUSED tokens, or
    cut to ``vocab`` (Phi-3's 32064) with the merges whose parts or result were cut dropped."""
    from pagedllm.models.gguf_loader import read_gguf
    from pagedllm.models.loader import default_model_path

    meta = read_gguf(default_model_path()).metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    merges = list(meta["tokenizer.ggml.merges"])
    ids = {key: int(meta[f"tokenizer.ggml.{key}"]) for key in ("bos_token_id", "eos_token_id", "unknown_token_id",
                                                                "padding_token_id") if f"tokenizer.ggml.{key}" in meta}
    if vocab < len(tokens):
        if any(i >= vocab for i in ids.values()):
            raise ValueError(f"vocab {vocab} cuts the default tokenizer's special tokens {ids}")
        tokens, types = tokens[:vocab], types[:vocab]
        kept = set(tokens)
        merges = [m for m in merges if (parts := m.split(" ")) and all(t in kept for t in (*parts, "".join(parts)))]
    pad = vocab - len(tokens)
    tokens += [f"<|extra_{n}|>" for n in range(pad)]
    types += [int(TokenType.UNUSED)] * pad
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    adders = {"bos_token_id": writer.add_bos_token_id, "eos_token_id": writer.add_eos_token_id,
              "unknown_token_id": writer.add_unk_token_id, "padding_token_id": writer.add_pad_token_id}
    for key, value in ids.items():
        adders[key](value)
    if "tokenizer.ggml.add_bos_token" in meta:
        writer.add_add_bos_token(bool(meta["tokenizer.ggml.add_bos_token"]))
    if "tokenizer.ggml.add_space_prefix" in meta:
        writer.add_add_space_prefix(bool(meta["tokenizer.ggml.add_space_prefix"]))
    if "tokenizer.chat_template" in meta:
        writer.add_chat_template(str(meta["tokenizer.chat_template"]))


def write_model(path: str, shape: Shape, kind: str, pure: bool, seed: int) -> None:
    plan = tensor_plan(shape, kind, pure)
    roles = [role for _, _, role in model_tensors(shape)]
    tmp = path + ".partial"
    writer = GGUFWriter(tmp, shape.arch)
    # llama.cpp keys per-token attributes on general.name: one containing "phi-3" / "phi3" makes it look up
    # the SentencePiece tokens "</s>", "<unk>", "<s>", which the default tokenizer lacks (unordered_map::at).
    # Titles with spaces, as the converter's ("Phi 3.5 Mini Instruct"); the Llamas keep theirs.
    title = shape.name if shape.arch == "llama" else shape.name.replace("-", " ")
    writer.add_name(f"{title} ({FILE_SUFFIXES[kind]}{', pure' if pure else ''}, random weights)")
    add_arch_metadata(writer, shape)
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
    for index, ((name, dims, qtype), role) in enumerate(zip(plan, roles, strict=True)):
        rng = np.random.default_rng([seed, index])  # per tensor: the same weights whatever is skipped
        if qtype == Q.F32:
            data = float_values(rng, dims, role)
        else:
            data = random_packed(rng, qtype, int(np.prod(dims[:-1])), dims[-1]).reshape(*dims[:-1], -1)
        writer.write_tensor_data(data)
        written += data.nbytes
        del data
        if index % 20 == 0 or index == len(plan) - 1:
            print(f"  {written / 2**30:6.2f} / {total / 2**30:.2f} GiB  {name}  "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    writer.close()
    os.replace(tmp, path)


def model_shape(model: str, tiny_variant: bool = False) -> Shape:
    return tiny(SHAPES[model]) if tiny_variant else SHAPES[model]


def model_path(out_dir: str, model: str, kind: str, pure: bool, tiny_variant: bool = False) -> str:
    suffix = FILE_SUFFIXES[kind] + ("-pure" if pure else "")
    return os.path.join(out_dir, f"{model_shape(model, tiny_variant).name}.{suffix}.gguf")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=[*SHAPES, "all", "zoo"], default=["1b"],
                        help="model shapes; 'zoo': the new ones (all but 1b and 8b); 'all': every one")
    parser.add_argument("--types", nargs="+", choices=[*FILE_TYPES, "all"], default=["q4_0", "q4_k_m"],
                        help="'all': q4_k_m q8_0 mxfp4 (each shape gets those that apply)")
    parser.add_argument("--pure", action="store_true", help="the output matrix in the base type too")
    parser.add_argument("--tiny", action="store_true", help="small variants of the shapes (2 layers, hidden 256)")
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rewrite files that exist")
    parser.add_argument("--check", action="store_true", help="only verify the random blocks against gguf-py")
    args = parser.parse_args(argv)
    models = [m for arg in args.models for m in ({"all": list(SHAPES), "zoo": list(ZOO)}.get(arg) or [arg])]
    kinds = [k for arg in args.types for k in (["q4_k_m", "q8_0", "mxfp4"] if arg == "all" else [arg])]
    explicit_types = "all" not in args.types
    for name, (mean, spread) in check_blocks(args.seed).items():
        print(f"block check {name}: dequantized mean {mean:+.1e}, std {spread:.4f} (target 0.02)")
    if args.check:
        return 0
    os.makedirs(args.out_dir, exist_ok=True)
    for model in dict.fromkeys(models):
        shape = model_shape(model, args.tiny)
        for kind in dict.fromkeys(kinds):
            reason = applicable(shape, kind)
            if reason is not None:
                if explicit_types:
                    print(f"skipped: {reason}")
                continue
            path = model_path(args.out_dir, model, kind, args.pure, args.tiny)
            if os.path.exists(path) and not args.force:
                print(f"{path} exists (--force rewrites it)")
                continue
            plan = tensor_plan(shape, kind, args.pure)
            need = sum(packed_nbytes(d, t) for _, d, t in plan)
            free = os.statvfs(args.out_dir).f_bavail * os.statvfs(args.out_dir).f_frsize
            if need * 1.05 > free:
                raise SystemExit(f"{path} needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
            print(f"writing {path} ({need / 2**30:.2f} GiB of tensors)", flush=True)
            start = time.perf_counter()
            write_model(path, shape, kind, args.pure, args.seed)
            print(f"wrote {path}: {os.path.getsize(path) / 2**30:.2f} GiB in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
