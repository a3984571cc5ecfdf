"""Memory saved by sharing (the paper's Figure 15) and shared-prefix throughput (Figure 16).

Part 1, memory: synthetic Alpaca-like (mean prompt 19.3, mean output 58.5 tokens) and ShareGPT-like
(161.3 / 338.0, long-tailed) traces, lognormal lengths, seeded. Every request of a trace is decoded
by parallel sampling (n = 2, 4, 6) or beam search (width 2, 4, 6) for exactly its trace output length
(ignore_eos), all requests at once in a pool large enough that nothing is preempted. After every
step the block manager reports the blocks in use and ``blocks_saved_by_sharing`` (blocks the live
block tables reference minus distinct blocks in use). Over the run:

    saved % = mean(saved) / mean(used + saved)     (time average over engine steps)

Prefix caching is off here so that only sharing inside a request counts.

Part 2, shared prefix: requests whose prompt is a 1-shot (~80 tokens) or 5-shot (~341 tokens)
few-shot prefix plus a short own suffix (Alpaca-like). The prefix is computed once first (the
paper's service provider keeps it cached); then all requests are timed with prefix caching on and
off in the same run. Throughput = requests / wall-clock seconds.

Scale: by default a tiny random Llama (2 layers, hidden 64, vocab 384, built on the spot), so the
whole run takes minutes on a CPU; ShareGPT-like lengths are scaled by ``--sharegpt-scale`` (default
0.25) and use blocks of 16 * scale tokens so tokens-per-block ratios match the paper's 16-token
blocks at full length. ``--model`` runs a real model instead (e.g. the embedded default with
``--model default``), ``--sharegpt-scale 1`` the full lengths.

    python benchmarks/sharing.py                       # tiny model, ~minutes on a CPU
    python benchmarks/sharing.py --model default --device cuda --sharegpt-scale 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.models.loader import load_model_config  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")

# (mean prompt, mean output) in tokens, from the paper's section 6.1.
TRACES = {"alpaca": (19.3, 58.5), "sharegpt": (161.3, 338.0)}
# Lognormal shape: ShareGPT's lengths vary far more than Alpaca's.
SIGMA = {"alpaca": 0.6, "sharegpt": 0.9}
PAPER_SAVINGS = {  # the paper's Figure 15 ranges, for the table
    ("alpaca", "parallel"): "6.1-9.8%",
    ("sharegpt", "parallel"): "16.2-30.5%",
    ("alpaca", "beam"): "37.6-55.2%",
    ("sharegpt", "beam"): "44.3-66.3%",
}


def lognormal_lengths(mean: float, sigma: float, count: int, rng: random.Random, low: int, high: int) -> list[int]:
    mu = math.log(mean) - sigma**2 / 2  # so that the (unclipped) mean is ``mean``
    return [min(high, max(low, round(rng.lognormvariate(mu, sigma)))) for _ in range(count)]


def make_trace(kind: str, count: int, seed: int, scale: float, vocab: int, max_len: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request."""
    rng = random.Random(seed)
    mean_prompt, mean_output = TRACES[kind]
    prompts = lognormal_lengths(mean_prompt * scale, SIGMA[kind], count, rng, 1, max_len // 2)
    outputs = lognormal_lengths(mean_output * scale, SIGMA[kind], count, rng, 1, max_len // 2)
    return [([rng.randrange(4, vocab) for _ in range(p)], o) for p, o in zip(prompts, outputs)]


def measure_sharing(llm: LLM, trace: list[tuple[list[int], int]], method: str, width: int) -> dict:
    engine = llm.llm_engine
    for i, (prompt, output_len) in enumerate(trace):
        if method == "parallel":
            params = SamplingParams(n=width, temperature=1.0, seed=i, max_tokens=output_len, ignore_eos=True)
        else:
            params = SamplingParams(use_beam_search=True, best_of=width, max_tokens=output_len, ignore_eos=True)
        engine.add_request(f"{method}{width}-{i}", prompt, params)
    used_sum = saved_sum = steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.get_stats()
        used_sum += stats["gpu_blocks_used"]
        saved_sum += stats["blocks_saved_by_sharing"]
        steps += 1
    stats = engine.get_stats()
    assert stats["num_preempted"] == 0, "the pool is too small: preemption would distort the measurement"
    return {
        "method": method,
        "width": width,
        "steps": steps,
        "mean_blocks_used": used_sum / steps,
        "mean_blocks_without_sharing": (used_sum + saved_sum) / steps,
        "saved_percent": 100.0 * saved_sum / (used_sum + saved_sum),
        "seconds": time.perf_counter() - start,
    }


def few_shot_prefix(num_tokens: int, rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(4, vocab) for _ in range(num_tokens)]


def measure_prefix(model: str, args: argparse.Namespace, prefix_len: int, vocab: int) -> dict:
    rng = random.Random(args.seed + prefix_len)
    prefix = few_shot_prefix(prefix_len, rng, vocab)
    suffix_lens = lognormal_lengths(TRACES["alpaca"][0], SIGMA["alpaca"], args.prefix_requests, rng, 4, 64)
    prompts = [prefix + [rng.randrange(4, vocab) for _ in range(n)] for n in suffix_lens]
    params = SamplingParams(temperature=0.0, max_tokens=args.prefix_output_len, ignore_eos=True)
    result: dict = {"prefix_tokens": prefix_len, "requests": len(prompts)}
    llms = {}
    for key, caching in (("off", False), ("on", True)):
        llms[key] = LLM(
            model=model, device=args.device, block_size=16, num_kv_blocks=args.prefix_kv_blocks,
            enable_prefix_caching=caching, max_num_seqs=args.max_num_seqs, seed=args.seed,
        )
        llms[key].generate([prefix + [5]], params, use_tqdm=False)  # the prefix computed once (and warm-up)
    times: dict[str, list[float]] = {"off": [], "on": []}
    before = {key: llm.llm_engine.get_stats() for key, llm in llms.items()}
    outputs = {}
    # Interleaved, so that a machine busy with something else slows both settings alike.
    for _ in range(args.repeats):
        for key, llm in llms.items():
            start = time.perf_counter()
            out = llm.generate(prompts, params, use_tqdm=False)
            times[key].append(time.perf_counter() - start)
            outputs[key] = [o.outputs[0].token_ids for o in out]
    for key, llm in llms.items():
        after = llm.llm_engine.get_stats()
        seconds = statistics.median(times[key])
        computed = after["prompt_tokens"] - before[key]["prompt_tokens"]
        hits = after["prefix_cache_hit_tokens"] - before[key]["prefix_cache_hit_tokens"]
        result[f"caching_{key}"] = {
            "seconds": seconds,
            "requests_per_s": len(prompts) / seconds,
            "prompt_tokens_computed": computed / args.repeats,
            "prefix_hit_tokens": hits / args.repeats,
        }
    result["speedup"] = result["caching_on"]["requests_per_s"] / result["caching_off"]["requests_per_s"]
    result["same_outputs"] = outputs["on"] == outputs["off"]
    return result


def resolve_model(name: str | None) -> str | None:
    if name == "default":
        return None
    if name is not None:
        return name
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from conftest import build_tiny_model

    return build_tiny_model("llama", tempfile.mkdtemp(prefix="pagedllm-tiny-"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or GGUF; 'default' = embedded SmolLM2-135M; "
                        "unset = a tiny random Llama built on the spot")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-requests", type=int, default=16, help="requests per trace and setting")
    parser.add_argument("--widths", type=int, nargs="*", default=[2, 4, 6])
    parser.add_argument("--traces", nargs="*", default=["alpaca", "sharegpt"], choices=sorted(TRACES))
    parser.add_argument("--sharegpt-scale", type=float, default=0.25, help="scale of ShareGPT-like lengths")
    parser.add_argument("--kv-blocks", type=int, default=16384, help="pool size for the memory runs")
    parser.add_argument("--prefix-shots", type=int, nargs="*", default=[80, 341], help="prefix lengths in tokens")
    parser.add_argument("--prefix-requests", type=int, default=32)
    parser.add_argument("--prefix-output-len", type=int, default=16)
    parser.add_argument("--prefix-kv-blocks", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=os.path.join(RESULTS_DIR, "sharing.json"))
    parser.add_argument("--png", default=os.path.join(RESULTS_DIR, "sharing.png"), help="'' skips the plot")
    args = parser.parse_args()

    model = resolve_model(args.model)
    memory_rows = []
    for kind in args.traces:
        scale = args.sharegpt_scale if kind == "sharegpt" else 1.0
        block_size = max(1, round(16 * scale))
        for method in ("parallel", "beam"):
            for width in args.widths:
                llm = LLM(model=model, device=args.device, block_size=block_size, num_kv_blocks=args.kv_blocks,
                          enable_prefix_caching=False, max_num_seqs=args.max_num_seqs, seed=args.seed)
                vocab = llm.llm_engine.vocab_size
                max_len = llm.llm_engine.max_seq_len
                trace = make_trace(kind, args.num_requests, args.seed, scale, vocab, max_len)
                row = measure_sharing(llm, trace, method, width)
                row.update(trace=kind, scale=scale, block_size=block_size,
                           mean_prompt=statistics.mean(len(p) for p, _ in trace),
                           mean_output=statistics.mean(o for _, o in trace))
                memory_rows.append(row)
                print(f"{kind:9s} {method:8s} {width}  saved {row['saved_percent']:5.1f}%  "
                      f"({row['steps']} steps, {row['seconds']:.1f} s)", flush=True)

    prefix_rows = []
    for prefix_len in args.prefix_shots:
        vocab = load_model_config(model).hf_config.vocab_size
        row = measure_prefix(model, args, prefix_len, vocab)
        prefix_rows.append(row)
        print(f"prefix {prefix_len:4d} tokens: {row['speedup']:.2f}x with caching", flush=True)

    print("\nFigure 15: KV blocks with and without sharing (time-averaged over engine steps)")
    print(f"{'trace':9s} {'method':9s} {'k':>2s} {'prompt':>7s} {'output':>7s} {'blocks':>8s} "
          f"{'no-share':>9s} {'saved':>7s}  paper")
    for r in memory_rows:
        print(f"{r['trace']:9s} {r['method']:9s} {r['width']:2d} {r['mean_prompt']:7.1f} {r['mean_output']:7.1f} "
              f"{r['mean_blocks_used']:8.1f} {r['mean_blocks_without_sharing']:9.1f} {r['saved_percent']:6.1f}%  "
              f"{PAPER_SAVINGS[(r['trace'], r['method'])]}")
    if prefix_rows:
        print("\nFigure 16: shared prefix, prefix caching on vs off")
        print(f"{'prefix':>6s} {'req':>4s} {'off req/s':>10s} {'on req/s':>9s} {'speedup':>8s} "
              f"{'computed off':>12s} {'computed on':>11s} same")
        for r in prefix_rows:
            off, on = r["caching_off"], r["caching_on"]
            print(f"{r['prefix_tokens']:6d} {r['requests']:4d} {off['requests_per_s']:10.2f} "
                  f"{on['requests_per_s']:9.2f} "
                  f"{r['speedup']:7.2f}x {off['prompt_tokens_computed']:12.0f} {on['prompt_tokens_computed']:11.0f} "
                  f"{r['same_outputs']}")

    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "model": args.model or "tiny-random-llama", "memory": memory_rows,
                   "prefix": prefix_rows}, f, indent=2)
    print(f"wrote {args.json}")
    if args.png:
        plot(memory_rows, prefix_rows, args.png)


def plot(memory_rows: list[dict], prefix_rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    traces = sorted({r["trace"] for r in memory_rows})
    fig, axes = plt.subplots(1, len(traces) + (1 if prefix_rows else 0), figsize=(5 * (len(traces) + 1), 4))
    axes = list(axes) if hasattr(axes, "__len__") else [axes]
    for ax, kind in zip(axes, traces):
        for offset, method in ((-0.2, "parallel"), (0.2, "beam")):
            rows = [r for r in memory_rows if r["trace"] == kind and r["method"] == method]
            ax.bar([i + offset for i in range(len(rows))], [r["saved_percent"] for r in rows], width=0.4,
                   label="parallel sampling (n)" if method == "parallel" else "beam search (k)")
            ax.set_xticks(range(len(rows)), [str(r["width"]) for r in rows])
        ax.set_title(f"{kind}-like: KV memory saved by sharing")
        ax.set_xlabel("n / beam width")
        ax.set_ylabel("saved %")
        ax.legend()
    if prefix_rows:
        ax = axes[-1]
        labels = [f"{r['prefix_tokens']}-token prefix" for r in prefix_rows]
        ax.bar([i - 0.2 for i in range(len(prefix_rows))], [r["caching_off"]["requests_per_s"] for r in prefix_rows],
               width=0.4, label="prefix caching off")
        ax.bar([i + 0.2 for i in range(len(prefix_rows))], [r["caching_on"]["requests_per_s"] for r in prefix_rows],
               width=0.4, label="prefix caching on")
        ax.set_xticks(range(len(prefix_rows)), labels)
        ax.set_ylabel("requests / s")
        ax.set_title("shared prefix throughput")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
