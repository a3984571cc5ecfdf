"""Load time and single-stream decode speed of one real-size random checkpoint per decoder family.

Each family gets a transformers checkpoint in the shape of a published model of that family
(safetensors, bfloat16, random weights), written once under --out-dir with the embedded default
model's tokenizer; pagedllm then loads it (``LLM(model=folder)``) and decodes one stream greedily
with EOS ignored. Llama-3.2-1B's shape runs alongside as the reference row.

    .venv/bin/python benchmarks/family_checkpoints.py
    .venv/bin/python benchmarks/family_checkpoints.py --families olmo2 granite --quantization int8

Figures per family: parameters, load seconds (the ``LLM(...)`` call: config, weights, packing,
KV pool), decode tok/s as the median over --repeats of (max_tokens=N+1 time - max_tokens=1
time) / N, which leaves the prompt out, the weight bytes a decode step reads times that rate (GB/s:
how models of different sizes compare, against the Llama row) and where the layers ran (the
engine's ``Layers:`` start-up line). Shapes too large for this machine's memory keep their
real layer width but fewer layers (``layers`` in the table says how many of how many); tok/s of
such a row scales with the layer count, load time roughly too.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.models.loader import resolve_model_path  # noqa: E402

DEFAULT_OUT_DIR = "/work/models/families"


@dataclass(frozen=True)
class Shape:
    """A published model's shape: its transformers config class and settings."""

    published: str
    config_class: str
    settings: dict[str, Any]
    layers_here: int | None = None  # fewer layers than published, to fit this machine
    extra: dict[str, Any] = field(default_factory=dict)


SHAPES: dict[str, Shape] = {
    "llama": Shape("meta-llama/Llama-3.2-1B", "LlamaConfig", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "olmo2": Shape("allenai/OLMo-2-0425-1B", "Olmo2Config", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=100352, rms_norm_eps=1e-6)),
    "olmo3": Shape("allenai/Olmo-3-1025-7B", "Olmo3Config", dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=100278, sliding_window=4096), layers_here=8),
    "granite": Shape("ibm-granite/granite-3.3-2b-instruct", "GraniteConfig", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=40, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=49159, tie_word_embeddings=True, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0)),
    "stablelm": Shape("stabilityai/stablelm-2-1_6b", "StableLmConfig", dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=100352, partial_rotary_factor=0.25, use_qkv_bias=True,
        tie_word_embeddings=False)),
    "phi": Shape("microsoft/phi-2", "PhiConfig", dict(
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=51200, partial_rotary_factor=0.4, tie_word_embeddings=False)),
    "cohere": Shape("CohereLabs/aya-expanse-8b", "CohereConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=256000, logit_scale=0.125, use_qk_norm=False), layers_here=8),
    "qwen2_moe": Shape("Qwen/Qwen1.5-MoE-A2.7B", "Qwen2MoeConfig", dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=151936, num_experts=60, num_experts_per_tok=4,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632, tie_word_embeddings=False),
        layers_here=4),
    "gpt_oss": Shape("openai/gpt-oss-20b", "GptOssConfig", dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, vocab_size=201088, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention"] * 12), layers_here=2,
        extra=dict(layer_types=["sliding_attention", "full_attention"])),
    "deepseek_v3": Shape("moonshotai/Moonlight-16B-A3B", "DeepseekV3Config", dict(
        hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=512,
        q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=163840,
        routed_scaling_factor=2.446, tie_word_embeddings=False), layers_here=3),
}


def checkpoint(name: str, out_dir: str, shape: Shape | None = None) -> tuple[str, int, str]:
    """(folder, parameters, layers label): the family's random checkpoint (``shape``, else the
    family's entry in SHAPES), written if missing."""
    import transformers

    shape = shape or SHAPES[name]
    settings = dict(shape.settings, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                    torch_dtype="bfloat16")
    published_layers = settings["num_hidden_layers"]
    if shape.layers_here:
        settings["num_hidden_layers"] = shape.layers_here
    settings.update(shape.extra)  # what must change with the layer count (layer_types)
    label = f"{settings['num_hidden_layers']}/{published_layers}"
    folder = os.path.join(out_dir, f"{name}-random")
    config = getattr(transformers, shape.config_class)(**settings)
    if not os.path.exists(os.path.join(folder, "config.json")):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(folder)
        default_tokenizer().save_pretrained(folder)
        del model
        gc.collect()
    return folder, *_count_params(folder), label


def _count_params(folder: str) -> tuple[int, int]:
    """(parameters, parameters a decode step reads): all but an untied input embedding, of which a
    step reads one row per token."""
    from safetensors import safe_open

    sizes: dict[str, int] = {}
    for file in os.listdir(folder):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(folder, file), "pt") as f:
                sizes.update({key: math.prod(f.get_slice(key).get_shape()) for key in f.keys()})
    total = sum(sizes.values())
    untied_embedding = any(key.endswith("lm_head.weight") for key in sizes)
    embedding = sum(n for key, n in sizes.items() if key.endswith("embed_tokens.weight")) if untied_embedding else 0
    return total, total - embedding


def default_tokenizer():
    """The embedded default model's tokenizer (SmolLM2, 49152 tokens: below every vocabulary here)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(None)
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def decode_tok_s(llm: LLM, prompt: list[int], new_tokens: int, repeats: int) -> float:
    def timed(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - start

    timed(2)  # warm-up: kernels, thread pool
    rates = []
    for _ in range(repeats):
        first = timed(1)
        rates.append(new_tokens / max(timed(new_tokens + 1) - first, 1e-9))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    parser.add_argument("--quantization", default=None, help="load-time quantization (int8, int4); default bf16")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()

    rows = []
    for name in args.families:
        folder, params, read_params, layers = checkpoint(name, args.out_dir)
        gc.collect()
        start = time.perf_counter()
        llm = LLM(model=folder, dtype="bfloat16", quantization=args.quantization, kv_cache_memory="256MiB",
                  max_model_len=1024)
        load_s = time.perf_counter() - start
        prompt = [100 + (7 * i) % 40000 for i in range(args.prompt_len)]
        rate = decode_tok_s(llm, prompt, args.new_tokens, args.repeats)
        weight_bytes = read_params * (2 if args.quantization is None else 1)  # bfloat16, or int8-sized rows
        row = dict(family=name, published=SHAPES[name].published, layers=layers, params_b=round(params / 1e9, 2),
                   load_s=round(load_s, 1), decode_tok_s=round(rate, 2),
                   weight_gb_s=round(rate * weight_bytes / 1e9, 2),
                   placement=getattr(llm.llm_engine, "layer_placement", "not reported"))
        rows.append(row)
        print(json.dumps(row), flush=True)
        del llm
        gc.collect()

    # Weight bytes streamed per second: what the tok/s of models of different sizes is compared by.
    reference = next((r["weight_gb_s"] for r in rows if r["family"] == "llama"), None)
    print(f"\n{'family':10} {'shape of':38} {'layers':>7} {'params':>7} {'load s':>7} {'tok/s':>7} {'GB/s':>6} "
          f"{'vs llama':>8}  layers run in")
    for r in rows:
        ratio = f"{r['weight_gb_s'] / reference:.2f}x" if reference else "-"
        print(f"{r['family']:10} {r['published']:38} {r['layers']:>7} {r['params_b']:>6}B {r['load_s']:>7} "
              f"{r['decode_tok_s']:>7} {r['weight_gb_s']:>6} {ratio:>8}  {r['placement'][:60]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(quantization=args.quantization, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
