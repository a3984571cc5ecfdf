"""Structured-output overhead: 64 JSON-schema requests against the same requests unconstrained.

A first constrained run fixes each request's output length; the unconstrained runs then generate
exactly as many tokens per request (max_tokens = that length, EOS ignored), so both do the same
model work and the difference is what constraining costs: filling each step's token bitmasks from
the grammar matchers, choosing among the allowed tokens, advancing the matchers. Prefix caching is
off (a later run would find the earlier run's prompts cached). Runs alternate over repeats (this
machine is shared and noisy); medians and their ratio are printed, with the mask cost per step measured on
its own: bitmask filling inside the runs; the greedy choice under masks (against the unconstrained
one) and the masking that sampling paths do, on a full batch timed apart.

    .venv/bin/python benchmarks/structured.py --num-requests 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima", "Kyoto", "Accra"]},
        "hobbies": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2,12}$"}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}


def prompts(llm: LLM, num: int) -> list[dict]:
    tokenizer = llm.get_tokenizer()
    result = []
    for i in range(num):
        messages = [{"role": "user", "content": f"Invent person number {i}: name, age, city and hobbies, as JSON."}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        result.append({"prompt": text})
    return result


def timed(llm: LLM, requests: list[dict], params: list[SamplingParams]) -> tuple[float, list[int]]:
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert llm.llm_engine.get_stats()["gpu_blocks_used"] == 0
    return elapsed, [len(o.outputs[0].token_ids) for o in outputs]


def sampler_seconds(manager, num_rows: int, vocab_size: int, repeats: int = 50) -> dict[str, float]:
    """Seconds per batch of logits, with real bitmasks, of the sampler's work under grammars: masking
    (the sampling paths), the greedy choice among the allowed tokens (greedy rows mask nothing), and
    the unconstrained greedy choice it replaces."""
    import torch

    from pagedllm.kernels.attention import greedy_pick
    from pagedllm.structured.bitmask import apply_token_bitmask, greedy_pick_masked

    matchers = [manager.new_matcher(StructuredOutputsParams(json=SCHEMA)) for _ in range(num_rows)]
    bitmask, _, _ = manager.fill_bitmasks(matchers)
    rows = list(bitmask.unbind(0))
    logits = torch.randn(num_rows, vocab_size)
    work = {"masking": lambda: apply_token_bitmask(logits.clone(), rows), "copy": logits.clone,
            "greedy_masked": lambda: greedy_pick_masked(logits, rows), "greedy_free": lambda: greedy_pick(logits)}
    seconds = {}
    for name, run in work.items():
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        seconds[name] = (time.perf_counter() - start) / repeats
    seconds["masking"] -= seconds.pop("copy")  # masking works in place: each repeat masks a fresh copy
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "results", "structured.json"))
    args = parser.parse_args()

    llm = LLM(args.model, num_threads=args.num_threads, device="auto", enable_prefix_caching=False)
    engine = llm.llm_engine
    manager = engine.structured_outputs
    requests = prompts(llm, args.num_requests)
    spec = StructuredOutputsParams(json=SCHEMA)
    constrained = [SamplingParams(max_tokens=args.max_tokens, temperature=0, structured_outputs=spec)] * len(requests)
    _, lengths = timed(llm, requests, constrained)  # warm-up; compiles the schema once (cached after)
    free = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]

    constrained_s, free_s, fill_s, fill_steps = [], [], [], []
    for repeat in range(args.repeats):
        for kind in (("constrained", "free") if repeat % 2 == 0 else ("free", "constrained")):
            if kind == "free":
                elapsed, free_lengths = timed(llm, requests, free)
                assert free_lengths == lengths
                free_s.append(elapsed)
                continue
            fill_before, steps_before = manager.fill_seconds, manager.num_fill_steps
            elapsed, run_lengths = timed(llm, requests, constrained)
            assert run_lengths == lengths  # greedy: the same outputs every run
            constrained_s.append(elapsed)
            fill_s.append(manager.fill_seconds - fill_before)
            fill_steps.append(manager.num_fill_steps - steps_before)
    sampler_ms = {name: 1e3 * value for name, value in
                  sampler_seconds(manager, len(requests), engine.vocab_size).items()}

    tokens = sum(lengths)
    constrained_tps = tokens / statistics.median(constrained_s)
    free_tps = tokens / statistics.median(free_s)
    fill_ms_per_step = 1e3 * statistics.median(f / max(s, 1) for f, s in zip(fill_s, fill_steps))
    steps = statistics.median(fill_steps)
    result = {
        "model": args.model or "SmolLM2-135M-Instruct (embedded)",
        "num_requests": len(requests),
        "generated_tokens": tokens,
        "constrained_s": constrained_s,
        "unconstrained_s": free_s,
        "constrained_tokens_per_s": constrained_tps,
        "unconstrained_tokens_per_s": free_tps,
        "slowdown": free_tps / constrained_tps - 1.0,
        "bitmask_fill_ms_per_step": fill_ms_per_step,
        "logit_masking_ms_per_step": sampler_ms["masking"],
        "greedy_masked_ms_per_step": sampler_ms["greedy_masked"],
        "greedy_unconstrained_ms_per_step": sampler_ms["greedy_free"],
        # Filling, and the greedy choice's extra time under masks (negative: it reads fewer logits).
        "mask_cost_share": (fill_ms_per_step + sampler_ms["greedy_masked"] - sampler_ms["greedy_free"]) * steps
        / 1e3 / statistics.median(constrained_s),
        "grammar_cache": {k: v for k, v in engine.get_stats().items() if k.startswith("grammar_cache")},
    }
    print(f"{len(requests)} requests, {tokens} tokens each run ({args.repeats} repeats, medians; shared machine)")
    print(f"  JSON schema   {constrained_tps:8.1f} tok/s")
    print(f"  unconstrained {free_tps:8.1f} tok/s")
    print(f"  constrained is {100 * result['slowdown']:+.1f}% slower (goal: <= 10%)")
    print(f"  mask cost per step ({len(requests)} rows): {fill_ms_per_step:.2f} ms filling bitmasks; greedy choice "
          f"{sampler_ms['greedy_masked']:.2f} ms among the allowed tokens vs {sampler_ms['greedy_free']:.2f} ms "
          f"unconstrained: {100 * result['mask_cost_share']:+.1f}% of the constrained run")
    print(f"  (sampling, not greedy, masks the logits first: {sampler_ms['masking']:.2f} ms)")
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump(result, handle, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
