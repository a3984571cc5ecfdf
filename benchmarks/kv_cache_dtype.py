"""Quantized KV cache (``kv_cache_dtype``): what 8 and 4 bits cost in accuracy.

``accuracy``: a fixed English text (benchmarks/data/: original prose, then the design brief) is
tokenized once and cut into windows of --window tokens, each window one prompt. Every KV dtype runs
the same windows teacher-forced (``SamplingParams(max_tokens=1, prompt_logprobs=1)``), which gives
per position the logprob of the text's own next token and the model's top-1 token. Per dtype:
perplexity (exp of minus the mean logprob of the text's tokens) and agreement (the fraction of
positions whose top-1 token equals the top-1 under ``auto``). Long prompts run in chunks
(chunked prefill) and every chunk attends over its context read back from the paged cache, so the
whole window is attended through the quantized pool, not through the step's float keys. Prefix
caching is off so no window reuses another's blocks.

With quantized weights (the default GGUF) on a CPU with integer dot products, every linear layer's
input is quantized to int8 per row by default; that rounding turns the KV formats' small
perturbations into step changes of a whole int8 level, so agreement there measures the activations'
rounding as much as the cache's. ``--int8-activations off`` keeps float activations and isolates
the cache's error.

    .venv/bin/python benchmarks/kv_cache_dtype.py accuracy
    .venv/bin/python benchmarks/kv_cache_dtype.py accuracy --window 2048 \\
        --json benchmarks/results/kv_cache_dtype_accuracy.json

Each quantized cache stores keys less the model's mean key (attention/key_offset.py, measured at
start-up). ``--without-key-offset int4 ...`` also runs those dtypes without it, as rows named
``int4/no-offset``, to show what the offset buys:

    .venv/bin/python benchmarks/kv_cache_dtype.py accuracy --int8-activations off \
        --kv-cache-dtypes auto int8 fp8 int4 --without-key-offset fp8 int4

Bars printed: perplexity within +0.5% of auto and agreement >= 98% for the 8-bit types (int8,
fp8_e4m3, fp8_e5m2); within +3% and >= 93% for int4.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.attention import key_offset  # noqa: E402
from pagedllm.kv_cache_format import parse_kv_cache_dtype  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data")
DEFAULT_TEXTS = [os.path.join(DATA, "kv_eval_prose.txt"), os.path.join(DATA, "kv_eval_design.txt")]
KV_DTYPES = ["auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4"]
INT8_ACTIVATIONS = {"default": None, "on": True, "off": False}
# (max perplexity increase over auto, min top-1 agreement with auto)
BARS = {"int8": (0.005, 0.98), "fp8_e4m3": (0.005, 0.98), "fp8_e5m2": (0.005, 0.98), "int4": (0.03, 0.93)}


def read_windows(tokenizer, paths: list[str], window: int, min_window: int) -> list[list[int]]:
    """The texts' tokens cut into consecutive windows of ``window`` tokens (a short tail is kept if it
    has at least ``min_window`` tokens)."""
    text = "\n\n".join(open(path, encoding="utf-8").read().strip() for path in paths)
    ids = list(tokenizer.encode(text))
    windows = [ids[i:i + window] for i in range(0, len(ids), window)]
    return [w for w in windows if len(w) >= min_window]


def teacher_forced(llm: LLM, windows: list[list[int]]) -> tuple[list[list[float]], list[list[int]], float]:
    """Per window, per predicted position: (the text token's logprob, the top-1 token); and seconds."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert llm.llm_engine.get_stats()["gpu_blocks_used"] == 0
    logprobs, top1 = [], []
    for window, output in zip(windows, outputs):
        entries = output.prompt_logprobs
        assert entries is not None and len(entries) == len(window) and entries[0] is None, "prompt_logprobs shape"
        # Each entry holds the text's token and the top-1 token: the top-1 is the larger of the two.
        logprobs.append([entry[token] for entry, token in zip(entries[1:], window[1:])])
        top1.append([max(entry, key=entry.get) for entry in entries[1:]])
    return logprobs, top1, elapsed


NO_OFFSET = "/no-offset"


def accuracy(args: argparse.Namespace) -> None:
    names = [parse_kv_cache_dtype(name).name for name in args.kv_cache_dtypes]
    if "auto" in names:
        names.remove("auto")
    names.insert(0, "auto")  # the reference runs first
    names += [parse_kv_cache_dtype(name).name + NO_OFFSET for name in args.without_key_offset]
    calibration_tokens = key_offset.CALIBRATION_TOKENS
    windows = None
    results: dict[str, dict] = {}
    reference_top1 = None
    for name in names:
        # No calibration tokens: the worker sets no key offset.
        key_offset.CALIBRATION_TOKENS = 0 if name.endswith(NO_OFFSET) else calibration_tokens
        llm = LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=name.removesuffix(NO_OFFSET),
                  kv_cache_memory=args.kv_cache_memory,
                  enable_prefix_caching=False, max_num_seqs=args.max_num_seqs, seed=0,
                  int8_activations=INT8_ACTIVATIONS[args.int8_activations])
        if windows is None:
            windows = read_windows(llm.get_tokenizer(), args.text, args.window, args.min_window)
            windows = windows[:args.max_windows] if args.max_windows else windows
            positions = sum(len(w) - 1 for w in windows)
            print(f"{len(windows)} windows of <= {args.window} tokens, {positions} predicted positions; "
                  f"model dtype {llm.llm_engine.model_config.dtype}, {llm.llm_engine.num_gpu_blocks} KV blocks (auto)")
        logprobs, top1, elapsed = teacher_forced(llm, windows)
        flat_lp = [v for row in logprobs for v in row]
        flat_top1 = [t for row in top1 for t in row]
        flat_text = [t for w in windows for t in w[1:]]
        if reference_top1 is None:
            reference_top1 = flat_top1
        agree = sum(a == b for a, b in zip(flat_top1, reference_top1)) / len(flat_top1)
        results[name] = {
            "perplexity": math.exp(-sum(flat_lp) / len(flat_lp)),
            "agreement": agree,
            "top1_is_text_token": sum(a == b for a, b in zip(flat_top1, flat_text)) / len(flat_top1),
            "num_gpu_blocks": llm.llm_engine.num_gpu_blocks,
            "seconds": elapsed,
            "logprobs": flat_lp,
        }
        print(f"  {name:9s} ppl {results[name]['perplexity']:.4f}  agreement {100 * agree:6.2f}%  "
              f"({elapsed:.1f} s, {results[name]['num_gpu_blocks']} blocks)")
        del llm
        gc.collect()

    base = results["auto"]
    base_lp = base["logprobs"]
    print("\n| KV dtype | perplexity | vs auto | top-1 agreement | mean abs dlogprob | top-1 = text | bar | pass |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    verdicts = {}
    for name, res in results.items():
        rel = res["perplexity"] / base["perplexity"] - 1
        res["perplexity_vs_auto"] = rel
        res["mean_abs_logprob_delta"] = sum(abs(a - b) for a, b in zip(res["logprobs"], base_lp)) / len(base_lp)
        bar, verdict = "", ""
        if name in BARS:  # the engine as it runs; the no-offset rows are for comparison
            max_rel, min_agree = BARS[name]
            ok = rel <= max_rel and res["agreement"] >= min_agree
            verdicts[name] = ok
            bar = f"ppl <= +{100 * max_rel:g}%, agree >= {100 * min_agree:g}%"
            verdict = "pass" if ok else "FAIL"
        print(f"| {name} | {res['perplexity']:.4f} | {100 * rel:+.3f}% | {100 * res['agreement']:.2f}% | "
              f"{res['mean_abs_logprob_delta']:.4f} | {100 * res['top1_is_text_token']:.2f}% | {bar} | {verdict} |")
    if args.json:
        with open(args.json, "w") as f:
            slim = {name: {k: v for k, v in res.items() if k != "logprobs"} for name, res in results.items()}
            json.dump({"args": vars(args), "num_windows": len(windows), "results": slim, "pass": verdicts}, f,
                      indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    acc = sub.add_parser("accuracy", help="perplexity and top-1 agreement against auto over a fixed text")
    acc.add_argument("--model", default=None, help="HF folder or GGUF (default: embedded SmolLM2-135M)")
    acc.add_argument("--dtype", default="auto", help="model dtype (auto: float32 for a GGUF)")
    acc.add_argument("--kv-cache-dtypes", nargs="+", default=KV_DTYPES)
    acc.add_argument("--text", nargs="+", default=DEFAULT_TEXTS, help="text files, joined in this order")
    acc.add_argument("--window", type=int, default=1024, help="tokens per prompt")
    acc.add_argument("--min-window", type=int, default=128, help="drop a shorter last window")
    acc.add_argument("--max-windows", type=int, default=0, help="use only the first N windows (0: all)")
    acc.add_argument("--kv-cache-memory", default="1GiB")
    acc.add_argument("--int8-activations", choices=list(INT8_ACTIVATIONS), default="default",
                     help="quantized weights' activations: the engine's default (int8 where the CPU has integer "
                          "dot products), or float (off)")
    acc.add_argument("--without-key-offset", nargs="*", default=[], metavar="KV_DTYPE",
                     help="also run these quantized dtypes with no key offset (rows named DTYPE/no-offset)")
    acc.add_argument("--max-num-seqs", type=int, default=256)
    acc.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    if args.mode == "accuracy":
        accuracy(args)


if __name__ == "__main__":
    main()
