"""What batch invariance costs: benchmarks/throughput.py's workload with ``batch_invariant`` on (the
default) and off, alternating in one process (this machine is shared and noisy: medians and their
ratio), plus a check that the on engine answers a greedy prompt alike alone and in the crowd.

    .venv/bin/python benchmarks/batch_invariance.py                      # the default workload
    .venv/bin/python benchmarks/batch_invariance.py --input-len 1024 2048 --output-len 16 32 --num-prompts 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from throughput import add_workload_args, make_requests, run_pagedllm  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.kernels import use_kernel_config  # noqa: E402
from pagedllm.models.loader import resolve_model_path  # noqa: E402


def greedy_alone_and_crowded(llm: LLM, requests) -> bool:
    """Whether the first request's greedy tokens and logprobs are the same alone and among the rest."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
    target = {"prompt_token_ids": requests[0][0]}
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0]
    crowd = [{"prompt_token_ids": ids} for ids, _ in requests[1:]]
    crowded = llm.generate(crowd[: len(crowd) // 2] + [target] + crowd[len(crowd) // 2:], params, use_tqdm=False)
    mine = crowded[len(crowd) // 2].outputs[0]
    return alone.token_ids == mine.token_ids and alone.logprobs == mine.logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    args = parser.parse_args()

    engines = {}
    for invariant in (True, False):
        with use_kernel_config(batch_invariant=invariant):
            # No prefix cache: every repeat computes its prompts again (a repeat would otherwise hit
            # the blocks of the one before and time decodes only).
            engines[invariant] = LLM(model=resolve_model_path(args.model), dtype=args.dtype,
                                     kv_cache_memory=args.kv_cache_memory, seed=args.seed,
                                     enable_prefix_caching=False)
    vocab = engines[True].llm_engine.vocab_size
    requests = make_requests(args.num_prompts, tuple(args.input_len), tuple(args.output_len), vocab, args.seed)
    print(f"{len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, "
          f"{sum(out for _, out in requests)} output tokens")
    results: dict[bool, list[float]] = {True: [], False: []}
    for invariant, llm in engines.items():  # warm-up
        with use_kernel_config(batch_invariant=invariant):
            run_pagedllm(llm, requests[:4])
    for repeat in range(args.repeats):
        for invariant in ((True, False) if repeat % 2 == 0 else (False, True)):
            with use_kernel_config(batch_invariant=invariant):
                elapsed, produced = run_pagedllm(engines[invariant], requests)
            results[invariant].append(produced / elapsed)
            print(f"[{repeat}] batch_invariant={invariant}: {produced / elapsed:.1f} output tok/s")
    on, off = statistics.median(results[True]), statistics.median(results[False])
    print(f"\nmedian output tok/s: invariant {on:.1f}, not invariant {off:.1f}; invariant / not: {on / off:.3f}")
    for invariant, llm in engines.items():
        with use_kernel_config(batch_invariant=invariant):
            same = greedy_alone_and_crowded(llm, requests[:48])
        print(f"batch_invariant={invariant}: greedy alone == in a batch of 48: {same}")


if __name__ == "__main__":
    main()
