"""What a rejected draft costs: a 1B-shape target with a small draft model, single stream, one run.

Both are random checkpoints (benchmarks/family_checkpoints.py writes them once under --out-dir, with
the embedded default model's tokenizer): the target in Llama-3.2-1B's shape, the draft in
SmolLM2-135M's shape with the target's vocabulary. A random draft agrees with a random target about
as often as chance, so nearly every draft is rejected: the run measures the price of speculation
that does not pay, on the engines

- ``off``: no speculation;
- ``draft-always``: the draft proposes k tokens every step and the per-request switch-off is
  disabled: each step pays k draft forwards and a (k+1)-token verification for about one token;
- ``draft``: the same with the default switch-off (after ``min_request_drafts`` draft tokens under
  ``min_request_acceptance`` accepted, the request stops speculating), which bounds that price.

Outputs must be identical to ``off``'s (the drafts never change what the target decodes). Figures:
decode tok/s as the median over --repeats of new tokens / (time of max_tokens=N+1 - time of
max_tokens=1), acceptance, and the extra milliseconds per output token over ``off``.

    flock /tmp/cpu.lock .venv/bin/python benchmarks/draft_model_cost.py --json benchmarks/results/draft_model_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

from family_checkpoints import DEFAULT_OUT_DIR, SHAPES, Shape, checkpoint  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402

DRAFT_SHAPE = Shape("HuggingFaceTB/SmolLM2-135M (vocabulary of Llama-3.2-1B)", "LlamaConfig", dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    vocab_size=SHAPES["llama"].settings["vocab_size"], tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0}))


def timed(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - start, list(out[0].outputs[0].token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    target, target_params, _ = checkpoint("llama", args.out_dir)
    draft, draft_params, _ = checkpoint("llama-135m-shape", args.out_dir, DRAFT_SHAPE)
    k = args.num_speculative_tokens
    configs = {
        "off": None,
        "draft-always": {"model": draft, "num_speculative_tokens": k, "min_request_drafts": 1 << 30},
        "draft": {"model": draft, "num_speculative_tokens": k},
    }
    engines = {name: LLM(model=target, dtype="bfloat16", kv_cache_memory="256MiB", max_model_len=1024,
                         speculative_config=config) for name, config in configs.items()}
    prompt = [100 + (7 * i) % 40000 for i in range(args.prompt_len)]
    for llm in engines.values():
        timed(llm, prompt, 2)  # warm-up: kernels, thread pool
    rates: dict[str, list[float]] = {name: [] for name in engines}
    reference = None
    for _ in range(args.repeats):
        for name, llm in engines.items():
            first, _ = timed(llm, prompt, 1)
            seconds, tokens = timed(llm, prompt, args.new_tokens + 1)
            rates[name].append(args.new_tokens / max(seconds - first, 1e-9))
            reference = reference or tokens
            if tokens != reference:
                raise SystemExit(f"{name}: output differs from off's")
            print(f"  {name}: {rates[name][-1]:.2f} tok/s", file=sys.stderr, flush=True)

    base = statistics.median(rates["off"])
    rows = []
    print(f"target {target_params / 1e9:.2f}B (Llama-3.2-1B shape), draft {draft_params / 1e6:.0f}M, bfloat16, "
          f"k={k}, {args.new_tokens} new tokens, medians of {args.repeats}; outputs identical")
    print(f"{'engine':13} {'tok/s':>7} {'vs off':>7} {'ms/token extra':>15} {'proposed':>9} {'accepted':>9} "
          f"{'switched off':>12}")
    for name, llm in engines.items():
        rate = statistics.median(rates[name])
        stats = llm.llm_engine.get_stats()
        row = dict(engine=name, tok_s=round(rate, 2), vs_off=round(rate / base, 3),
                   extra_ms_per_token=round(1000 / rate - 1000 / base, 1),
                   proposed=stats.get("spec_decode_num_draft_tokens", 0),
                   accepted=stats.get("spec_decode_num_accepted_tokens", 0),
                   requests_switched_off=stats.get("spec_decode_requests_switched_off", 0), rates=rates[name])
        rows.append(row)
        print(f"{name:13} {row['tok_s']:7.2f} {row['vs_off']:6.2f}x {row['extra_ms_per_token']:15.1f} "
              f"{row['proposed']:9d} {row['accepted']:9d} {row['requests_switched_off']:12d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(target_params=target_params, draft_params=draft_params, k=k, new_tokens=args.new_tokens,
                           repeats=args.repeats, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
