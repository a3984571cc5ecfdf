"""The transformers reference that greedy-equality tests compare the engine with, and its sanity check.

A tiny random model can fall into repeating one token; an engine that also repeats it "agrees" while
proving little (a broken attention or position path often yields exactly such a constant stream). So
every greedy reference over a random model passes ``assert_not_degenerate`` before it is compared.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# More than 3 distinct tokens per sequence: the bar test_engine.py has held since its first version.
MIN_DISTINCT_TOKENS = 4


def assert_not_degenerate(token_ids: Sequence[int] | Sequence[Sequence[int]],
                          min_distinct: int = MIN_DISTINCT_TOKENS) -> None:
    """Each sequence (or the one sequence given) holds at least ``min_distinct`` distinct tokens."""
    sequences = [token_ids] if not token_ids or isinstance(token_ids[0], int) else token_ids
    for i, ids in enumerate(sequences):
        distinct = len(set(ids))
        assert distinct >= min_distinct, (
            f"reference sequence {i} is degenerate: {distinct} distinct token(s) < {min_distinct} in {list(ids)}"
        )


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32, min_distinct: int = MIN_DISTINCT_TOKENS) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (EOS an ordinary token, like ignore_eos),
    checked not to be degenerate."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    # Like ignore_eos: EOS is an ordinary token (min_new_tokens would instead forbid it).
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=3,  # the tiny models' <pad>; one unpadded sequence never reads it
            )
            outputs.append(out[0, len(ids) :].tolist())
    assert_not_degenerate(outputs, min_distinct)
    return outputs


def assert_engine_greedy_equals_transformers(hf_model, tokenizer, folder: str) -> None:
    """Through the engine (scheduler, block manager, sampler) on ``hf_model`` saved with ``tokenizer``
    in ``folder``: greedy tokens equal transformers' (a reference checked not to be degenerate),
    and every block goes back to the pool."""
    from conftest import assert_no_leaks

    from pagedllm import LLM, SamplingParams

    hf_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=64)
    prompts = [[(7 * i + 3 * n) % 380 + 4 for i in range(n)] for n in (3, 11, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(folder, prompts, 12)
    assert_no_leaks(llm)
