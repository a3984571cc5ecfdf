"""Chunked prefill with sliding windows and soft-capped attention, against transformers.

Mistral attends through an 8-position window in every layer, so the block manager releases the
blocks before it; Gemma 2 alternates windowed and full layers and soft-caps its scores. Prompts
of 3 to 30 tokens under step budgets of 7 and 16 tokens are computed chunk by chunk, in steps
shared with other sequences' decodes, through the C++ chunked kernel and the torch path.
"""

from __future__ import annotations

import pytest
from conftest import assert_no_leaks
from oracle import hf_greedy
from test_model_families import WINDOW, family_dir  # noqa: F401 (a fixture)

from pagedllm import LLM, SamplingParams
from pagedllm.attention import PagedAttention

NUM_NEW_TOKENS = 12
PROMPT_LENS = (3, 17, 30, 11)


@pytest.fixture(scope="module")
def expected(family_dir):  # noqa: F811
    prompts = [[(7 * i + 3 * n) % 380 + 4 for i in range(n)] for n in PROMPT_LENS]
    cache: dict[str, list[list[int]]] = {}

    def get(name: str) -> tuple[list[list[int]], list[list[int]]]:
        if name not in cache:
            cache[name] = hf_greedy(family_dir(name), prompts, NUM_NEW_TOKENS)
        return prompts, cache[name]

    return get


@pytest.mark.parametrize("use_cpu_kernel", [True, False])
@pytest.mark.parametrize("budget", [7, 16])
@pytest.mark.parametrize("name", ["mistral-window", "gemma2"])
def test_chunked_prefill_with_windows_equals_transformers(family_dir, expected, name, budget, use_cpu_kernel):  # noqa: F811
    prompts, want = expected(name)
    llm = LLM(family_dir(name), dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=budget)
    engine = llm.llm_engine
    for module in engine.worker.runner.model.modules():
        if isinstance(module, PagedAttention):
            module.use_cpu_kernel = use_cpu_kernel
    manager = engine.scheduler.block_manager
    schedule = engine.scheduler.schedule
    num_mixed_steps = 0
    max_dropped = 0

    def checking_schedule():
        nonlocal num_mixed_steps, max_dropped
        out = schedule()
        counts = set(out.num_scheduled_tokens.values())
        num_mixed_steps += 1 in counts and max(counts) > 1
        for group in out.scheduled_seq_groups:
            for seq in group.get_seqs():
                if seq.seq_id not in out.num_scheduled_tokens:
                    continue
                table = manager.block_tables[seq.seq_id]
                # Released blocks lie wholly before this step's first query's window: every chunk
                # still to come (and this one) reads only blocks the sequence holds.
                assert table.num_dropped * 4 <= max(0, seq.num_computed_tokens - WINDOW + 1)
            max_dropped = max(max_dropped, table.num_dropped)
        return out

    engine.scheduler.schedule = checking_schedule
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert num_mixed_steps > 0
    # Every Mistral layer has the window, so blocks before it go back to the pool; Gemma 2's
    # full-attention layers keep them all.
    assert (max_dropped > 0) == (name == "mistral-window")
    assert_no_leaks(llm)
