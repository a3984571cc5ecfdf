"""pagedllm runner of benchmarks/quantized.py (protocol: _child.py). Runs in pagedllm's .venv.

Options (JSON): ``llm`` — extra ``LLM(...)`` keyword arguments (``{"quantization": "int8"}``);
``kv_tokens`` — KV cache slots to allocate (the largest concurrent load of the run, so pagedllm
holds no more KV memory than the run needs); ``max_num_seqs``. Kernel switches come in as
environment variables (``--pagedllm-env`` of quantized.py), set before pagedllm is imported.

Single-stream decode time comes from the request's own metrics: first to last token time.
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from _child import main  # noqa: E402

BLOCK_SIZE = 16


def weight_bytes(model: Any) -> int:
    """Bytes of the tensors the model holds, each storage counted once: parameters, buffers and tensors
    reachable from module attributes through plain objects, slots, lists and dicts (packed weights live in
    such holders, oneDNN-reordered copies in plain attributes). KV cache and activations are not modules'."""
    import torch

    seen_storage: set[int] = set()
    seen_obj: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        try:
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # opaque (mkldnn) tensors have no storage view
            key, size = id(t), t.numel() * t.element_size()
        if key not in seen_storage:
            seen_storage.add(key)
            total += size

    def walk(value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            add(value)
            return
        if depth > 6 or id(value) in seen_obj or isinstance(value, torch.nn.Module | type | str | bytes | int | float):
            return
        seen_obj.add(id(value))
        if isinstance(value, list | tuple | set):
            items = list(value)
        elif isinstance(value, dict):
            items = list(value.values())
        else:
            items = list(getattr(value, "__dict__", {}).values())
            items += [getattr(value, n, None) for n in getattr(type(value), "__slots__", ())]
        for item in items:
            walk(item, depth + 1)

    for module in model.modules():
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            add(t)
        for name, value in vars(module).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                walk(value, 0)
    return total


class PagedLLMRunner:
    def __init__(self, model: str, threads: int, options: dict[str, Any]) -> None:
        from pagedllm import LLM

        kv_tokens = int(options.get("kv_tokens", 4096))
        self.llm = LLM(model=model, num_threads=threads, num_kv_blocks=-(-kv_tokens // BLOCK_SIZE) + 4,
                       block_size=BLOCK_SIZE, max_num_seqs=int(options.get("max_num_seqs", 256)),
                       **options.get("llm", {}))

    def _generate(self, prompts: list[list[int]], max_tokens: int) -> list[Any]:
        from pagedllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], [params] * len(prompts),
                                 use_tqdm=False)

    def single(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        (out,) = self._generate([prompt], max_tokens)
        m = out.metrics
        # arrival -> first token: the prompt's pass (first_scheduled_time is stamped after the step, with it).
        return {"prefill_s": m.first_token_time - m.arrival_time,
                "decode_s": m.last_token_time - m.first_token_time, "tokens": len(out.outputs[0].token_ids)}

    def batch(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        import time

        start = time.perf_counter()
        outs = self._generate(prompts, max_tokens)
        elapsed = time.perf_counter() - start
        return {"elapsed": elapsed, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}

    def memory(self) -> dict[str, Any]:
        worker = self.llm.llm_engine.worker
        model = getattr(worker, "model", None)
        return {"weight_bytes": weight_bytes(model) if model is not None else None}


def preload() -> None:
    """Libraries, not the model: torch, the C++ extension, transformers' config and tokenizer classes
    (imported lazily on first use, which would otherwise land inside the load time)."""
    import torch.distributed.tensor  # noqa: F401  (transformers' model configs import it)
    import transformers
    import transformers.utils.type_validators  # noqa: F401  (every model config imports it)

    import pagedllm.entrypoints.llm  # noqa: F401  (torch and the engine: ``import pagedllm`` alone is lazy)
    from pagedllm.kernels import cpu_kernels

    # Loaded (and built, after a change to their sources: ~3 minutes) before the clock: a rebuild once
    # counted in a gpt-oss-20b load as 199 s.
    cpu_kernels()
    transformers.PreTrainedTokenizerFast, transformers.PretrainedConfig  # noqa: B018  (resolve the lazy names)


if __name__ == "__main__":
    raise SystemExit(main(PagedLLMRunner, preload))
