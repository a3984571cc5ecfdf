"""What int8 activations cost in accuracy: perplexity and greedy agreement against float activations.

Both engines load the same packed weights (the default model unless --model); one multiplies them
with float32 activations (the dequantized model's results, token for token), the other with
activations quantized to int8 per block of 32 (``int8_activations``). Printed:
- perplexity of each on a fixed text (the docstrings of a few standard-library modules, in windows
  of --window tokens), and their ratio (bar: within 1%);
- greedy agreement over the first --new-tokens tokens of 16 prompts: teacher-forced (the float
  engine's greedy continuation is fed to the int8 model; the share of positions whose argmax is
  the same token) and free-running (the share of positions where both engines' own greedy
  outputs hold the same token).

On a CPU with AMX the int8 engine multiplies rows of 32 and more (the prompts that score the text)
in bfloat16 on AMX tiles; ``PAGEDLLM_INT8_AMX_MIN_ROWS=0`` keeps every product on int8.

    .venv/bin/python benchmarks/int8_activations.py [--model FILE.gguf]
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import logging
import math
import string
import textwrap

import torch

from pagedllm import LLM, SamplingParams

PROMPTS = [
    "The capital of France is", "Write a haiku about the sea:", "def fibonacci(n):\n    ", "Once upon a time",
    "List three colours:", "Translate to French: I like cheese.", "The PagedAttention algorithm stores",
    "1, 2, 3, 4,", "Explain photosynthesis in one sentence.", "import numpy as np\n", "Dear Sir or Madam,",
    "The three laws of motion are", "SELECT name FROM users WHERE", "A recipe for pancakes:",
    "The best way to learn a language is", "In 1969, the first humans",
]


def fixed_text() -> str:
    """A few thousand tokens of English prose that every Python 3 install carries."""
    return "\n\n".join(inspect.getdoc(m) or "" for m in (argparse, collections, json, logging, string, textwrap))


def _model(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.worker.model


def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits at every position of ``ids`` (one causal pass, no KV cache)."""
    model = _model(llm)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), None, None)
        return model.compute_logits(hidden).float()


def perplexity(llm: LLM, ids: list[int], window: int) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1]
        if len(chunk) < 2:
            break
        logp = torch.log_softmax(_logits(llm, chunk[:-1]), dim=-1)
        nll -= float(logp.gather(1, torch.tensor(chunk[1:]).unsqueeze(1)).sum())
        count += len(chunk) - 1
    return math.exp(nll / count)


def greedy(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def teacher_forced_agreement(llm: LLM, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    same = total = 0
    for prompt, cont in zip(prompts, continuations):
        logits = _logits(llm, prompt + cont[:-1])[len(prompt) - 1:]
        same += int((logits.argmax(-1) == torch.tensor(cont)).sum())
        total += len(cont)
    return same / total


def measure(model: str | None, new_tokens: int = 64, window: int = 512, prompts: list[str] = PROMPTS,
            text_tokens: int | None = None) -> dict:
    engines = {name: LLM(model=model, int8_activations=flag, kv_cache_memory="512MiB")
               for name, flag in (("float", False), ("int8", True))}
    tokenizer = engines["float"].get_tokenizer()
    text_ids = tokenizer.encode(fixed_text())[:text_tokens]
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    result = {"text_tokens": len(text_ids), "prompts": len(prompts), "new_tokens": new_tokens}
    for name, llm in engines.items():
        result[f"perplexity_{name}"] = perplexity(llm, text_ids, window)
    result["perplexity_ratio"] = result["perplexity_int8"] / result["perplexity_float"]
    reference = greedy(engines["float"], prompt_ids, new_tokens)
    own = greedy(engines["int8"], prompt_ids, new_tokens)
    result["agreement_teacher_forced"] = teacher_forced_agreement(engines["int8"], prompt_ids, reference)
    result["agreement_free_running"] = (
        sum(a == b for r, o in zip(reference, own) for a, b in zip(r, o)) / sum(len(r) for r in reference)
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file or HF folder with --quantization (default model)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    result = measure(args.model, args.new_tokens, args.window)
    print(f"perplexity over {result['text_tokens']} tokens: float activations {result['perplexity_float']:.4f}, "
          f"int8 activations {result['perplexity_int8']:.4f} (ratio {result['perplexity_ratio']:.4f}; bar <= 1.01)")
    print(f"greedy agreement over {result['prompts']} prompts x {result['new_tokens']} tokens: teacher-forced "
          f"{100 * result['agreement_teacher_forced']:.1f}% (bar >= 95%), free-running "
          f"{100 * result['agreement_free_running']:.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
