"""The default model packed (its GGUF's Q4_1 / Q8_0 blocks) against the same model in float32, in one run.

The workload is benchmarks/peers.py's ``default`` (64 ShareGPT-shaped requests, greedy, EOS ignored).
Three pagedllm engines, measured in turn ``--repeats`` times, medians reported:
- ``packed``: ``LLM()`` on the GGUF, weights kept in their blocks (the packed kernels; int8
  activations where the CPU has integer dot products);
- ``packed-float-act``: the same with ``int8_activations=False`` (float activations);
- ``dequantized``: ``LLM(quantization="dequantize")``, the GGUF dequantized to float32 (oneDNN);
- ``hf-float32``: the Hugging Face float32 folder peers.py converts from the GGUF, the engine peers.py
  measures as pagedllm's float32 figure.

    .venv/bin/python benchmarks/packed_vs_float.py --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peers import ensure_model, hf_vocab_size, make_workload  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "pagedllm", "peers"),
                        help="where peers.py keeps its converted models")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from pagedllm import LLM, SamplingParams
    from pagedllm.quantization.apply import packed_weight_bytes

    model_dir = ensure_model("default", args.cache_dir, args.seed)
    wl = make_workload("default", model_dir, hf_vocab_size(model_dir), args.seed, args.num_prompts)
    engines = {
        "packed": LLM(kv_cache_memory="2GiB", num_threads=args.threads),
        "packed-float-act": LLM(kv_cache_memory="2GiB", num_threads=args.threads, int8_activations=False),
        "dequantized": LLM(quantization="dequantize", kv_cache_memory="2GiB", num_threads=args.threads),
        "hf-float32": LLM(model=model_dir, dtype="float32", kv_cache_memory="2GiB", num_threads=args.threads),
    }
    prompts = [{"prompt_token_ids": ids} for ids in wl.prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.max_tokens]
    total_out = sum(wl.max_tokens)
    for llm in engines.values():  # warm-up: kernels built, allocator settled
        llm.generate(prompts[:8], params[:8], use_tqdm=False)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        order = list(engines)[repeat % len(engines):] + list(engines)[:repeat % len(engines)]
        for name in order:
            start = time.perf_counter()
            outs = engines[name].generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            rates[name].append(total_out / elapsed)
            outputs[name] = [list(o.outputs[0].token_ids) for o in outs]
            print(f"[{repeat}] {name:12s} {total_out / elapsed:8.1f} output tok/s ({elapsed:.1f} s)", flush=True)
    print(f"\n{len(prompts)} requests, {total_out} output tokens, {args.threads} threads; medians of {args.repeats}")
    for name, llm in engines.items():
        weights = packed_weight_bytes(llm.llm_engine.worker.runner.model)[0]
        rate = statistics.median(rates[name])
        print(f"  {name:12s} {rate:8.1f} tok/s   packed weight bytes {weights / 2**20:.1f} MiB")
    base = statistics.median(rates["hf-float32"])
    print("  " + "; ".join(f"{name} / hf-float32: {statistics.median(rates[name]) / base:.2f}x"
                           for name in engines if name != "hf-float32"))
    # Float activations compute the dequantized model's products: the same greedy tokens. int8
    # activations round them (benchmarks/int8_activations.py measures how much that matters).
    for name in ("packed-float-act", "packed"):
        agree = sum(a == b for a, b in zip(outputs[name], outputs["dequantized"]))
        print(f"  greedy outputs {name} == dequantized: {agree}/{len(prompts)} requests")


if __name__ == "__main__":
    main()
