"""Chunked prefill end to end: prompts split over steps, mixed with decodes, equal transformers.

Greedy output must equal transformers' token for token whatever the step budget (chunks of 1,
7, 16, 64 tokens), with and without prefix caching, when groups are preempted in the middle of
a chunked prompt (recompute and swap), and for parallel sampling and beam search, whose outputs
must not change with chunking.
"""

from __future__ import annotations

import pytest
from conftest import assert_no_leaks
from oracle import hf_greedy
from test_engine import NUM_NEW_TOKENS, _prompts

from pagedllm import LLM, SamplingParams
from pagedllm.sequence import SequenceStatus

GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def prompts_and_expected(llama_dir):
    prompts = _prompts(384)
    # Two more sharing the longest prompt's first 40 tokens: prefix-cache hits on blocks
    # another request computed chunk by chunk.
    prompts += [prompts[7][:40] + [5, 6, 7], prompts[7][:40] + [9] * 20]
    return prompts, hf_greedy(llama_dir, prompts, NUM_NEW_TOKENS)


def _is_decode(seq) -> bool:
    """Whether a scheduled sequence computes a decode token (not a prompt chunk) this step."""
    return seq.get_num_uncomputed_tokens() == 1 and bool(seq.output_token_ids)


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("budget", [1, 7, 16, 64])
@pytest.mark.parametrize("caching", [False, True])
def test_chunked_greedy_equals_transformers(llama_dir, prompts_and_expected, budget, caching):
    prompts, expected = prompts_and_expected
    llm = LLM(model=llama_dir, dtype="float32", num_kv_blocks=256, block_size=8, max_num_batched_tokens=budget,
              enable_prefix_caching=caching)
    engine = llm.llm_engine
    steps: list[tuple[int, bool]] = []  # (tokens, mixed decodes and a prompt chunk)
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        kinds = {
            _is_decode(seq)
            for group in out.scheduled_seq_groups for seq in group.get_seqs(SequenceStatus.RUNNING)
            if seq.seq_id in out.num_scheduled_tokens
        }
        steps.append((out.num_batched_tokens, len(kinds) == 2))
        return out

    engine.scheduler.schedule = recording_schedule
    assert [ids[0] for ids in _generate(llm, prompts, GREEDY)] == expected
    assert max(tokens for tokens, _ in steps) <= budget
    if budget > 1:
        assert any(mixed for _, mixed in steps)  # decodes and prompt chunks shared steps
    if caching:
        assert engine.get_stats()["prefix_cache_hit_tokens"] > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("caching", [False, True])
def test_several_capped_prompt_chunks_per_step_equal_transformers(llama_dir, prompts_and_expected, caching):
    prompts, expected = prompts_and_expected
    llm = LLM(model=llama_dir, dtype="float32", num_kv_blocks=256, block_size=8, max_num_batched_tokens=64,
              long_prefill_token_threshold=7, enable_prefix_caching=caching)
    scheduler = llm.llm_engine.scheduler
    chunks_per_step: list[list[int]] = []
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        chunks_per_step.append([n for n in out.num_scheduled_tokens.values() if n > 1])
        return out

    scheduler.schedule = recording_schedule
    assert [ids[0] for ids in _generate(llm, prompts, GREEDY)] == expected
    assert max(max(chunks, default=0) for chunks in chunks_per_step) == 7
    assert max(len(chunks) for chunks in chunks_per_step) > 1  # prompts shared the budget
    assert_no_leaks(llm)


@pytest.mark.parametrize("caching", [False, True])
def test_prompts_over_the_budget_in_long_prompt_chunks_equal_transformers(llama_dir, prompts_and_expected, caching):
    """Budget 32: prompts of up to 32 tokens take what the budget leaves (whole when it can), longer
    ones (43-64 tokens) 5 tokens a step."""
    prompts, expected = prompts_and_expected
    llm = LLM(model=llama_dir, dtype="float32", num_kv_blocks=256, block_size=8, max_num_batched_tokens=32,
              long_prompt_chunk_tokens=5, enable_prefix_caching=caching)
    scheduler = llm.llm_engine.scheduler
    chunks: dict[str, list[int]] = {}
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        for group in out.scheduled_seq_groups:
            for seq in group.seqs:
                if seq.prompt_len > 1 and out.num_scheduled_tokens.get(seq.seq_id, 0) > 1:
                    chunks.setdefault(group.request_id, []).append(out.num_scheduled_tokens[seq.seq_id])
        return out

    scheduler.schedule = recording_schedule
    assert [ids[0] for ids in _generate(llm, prompts, GREEDY)] == expected
    long = [sizes for r, sizes in chunks.items() if len(prompts[int(r)]) > 32]
    short = [sizes for r, sizes in chunks.items() if len(prompts[int(r)]) <= 32]
    assert long and all(max(sizes) <= 5 for sizes in long)
    assert any(max(sizes) > 5 for sizes in short)  # not capped
    assert_no_leaks(llm)


@pytest.mark.parametrize("caching", [False, True])
def test_prompt_tokens_capped_while_decoding_equal_transformers(llama_dir, prompts_and_expected, caching):
    """Budget 64, at most 5 prompt tokens in a step that decodes: the first prompts run whole,
    the rest advance 5 tokens a step beside the decodes."""
    prompts, expected = prompts_and_expected
    llm = LLM(model=llama_dir, dtype="float32", num_kv_blocks=256, block_size=8, max_num_batched_tokens=64,
              max_prefill_tokens_while_decoding=5, enable_prefix_caching=caching)
    scheduler = llm.llm_engine.scheduler
    steps: list[tuple[int, int]] = []  # (decode tokens, prompt tokens)
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        decodes = prompt = 0
        for group in out.scheduled_seq_groups:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                tokens = out.num_scheduled_tokens.get(seq.seq_id, 0)
                if _is_decode(seq):
                    decodes += tokens
                else:
                    prompt += tokens
        steps.append((decodes, prompt))
        return out

    scheduler.schedule = recording_schedule
    assert [ids[0] for ids in _generate(llm, prompts, GREEDY)] == expected
    assert max(prompt for decodes, prompt in steps if not decodes) > 5  # no decodes: the whole budget
    assert any(decodes and prompt for decodes, prompt in steps)
    assert all(prompt <= 5 for decodes, prompt in steps if decodes)
    assert_no_leaks(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_in_the_middle_of_a_chunked_prompt(llama_dir, prompts_and_expected, mode):
    prompts, expected = prompts_and_expected
    # 44 blocks of 4 slots cannot hold every sequence at full length: decodes preempt newer groups,
    # which with a 7-token budget are still computing their prompts.
    llm = LLM(model=llama_dir, dtype="float32", num_kv_blocks=44, block_size=4, max_num_batched_tokens=7,
              preemption_mode=mode, swap_space="4MB", enable_prefix_caching=False)
    scheduler = llm.llm_engine.scheduler
    preempted_mid_prompt = []
    preempt = scheduler._preempt

    def recording_preempt(group, outputs):
        seq = group.seqs[0]
        preempted_mid_prompt.append(0 < seq.num_computed_tokens < seq.get_len() - 1)
        preempt(group, outputs)

    scheduler._preempt = recording_preempt
    assert [ids[0] for ids in _generate(llm, prompts, GREEDY)] == expected
    assert any(preempted_mid_prompt)
    stats = scheduler.get_stats()
    assert stats[f"num_preempted_by_{mode}"] >= 1
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(n=2, best_of=3, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
        SamplingParams(use_beam_search=True, best_of=4, n=2, max_tokens=12, ignore_eos=True),
    ],
    ids=["n3", "best_of", "beam"],
)
def test_samples_and_beams_do_not_change_with_chunking(llama_dir, params):
    prompts = _prompts(384, count=8)[3:]
    whole = LLM(model=llama_dir, dtype="float32", num_kv_blocks=256, block_size=4, enable_chunked_prefill=False)
    chunked = LLM(model=llama_dir, dtype="float32", num_kv_blocks=256, block_size=4, max_num_batched_tokens=7)
    assert _generate(chunked, prompts, params) == _generate(whole, prompts, params)
    # Forks happened when the last chunk was done: samples share the prompt's full blocks.
    assert chunked.llm_engine.get_stats()["num_cow_copies"] > 0
    assert_no_leaks(whole)
    assert_no_leaks(chunked)


def test_prompt_longer_than_the_budget_runs(llama_dir):
    llm = LLM(model=llama_dir, dtype="float32", num_kv_blocks=64, block_size=8, max_num_batched_tokens=16)
    prompt = _prompts(384)[-1]  # 64 tokens: four chunks
    output = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert output.error is None and len(output.outputs[0].token_ids) == NUM_NEW_TOKENS
    # Without chunking the same budget refuses it, naming the setting to change.
    whole = LLM(model=llama_dir, dtype="float32", num_kv_blocks=64, block_size=8, max_num_batched_tokens=16,
                enable_chunked_prefill=False)
    refused = whole.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert refused.error and "max_num_batched_tokens=16" in refused.error
    assert_no_leaks(llm)
    assert_no_leaks(whole)


@pytest.mark.parametrize("budget", [7, 16])
def test_prompt_logprobs_are_the_same_chunked(llama_dir, prompts_and_expected, budget):
    """Each chunk reports the logprobs of the prompt tokens its positions predict, the next chunk's
    first token included; together they equal one whole-prompt pass's."""
    prompts = prompts_and_expected[0][:6]
    params = SamplingParams(max_tokens=3, prompt_logprobs=2, temperature=0.0)

    def run(**kwargs) -> list:
        llm = LLM(model=llama_dir, dtype="float32", num_kv_blocks=256, block_size=8, **kwargs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_no_leaks(llm)
        return outs

    whole = run(enable_chunked_prefill=False)
    chunked = run(max_num_batched_tokens=budget)
    for prompt, a, b in zip(prompts, whole, chunked):
        assert len(b.prompt_logprobs) == len(prompt) and b.prompt_logprobs[0] is None
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ref, got in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert ref.keys() == got.keys()
            assert all(abs(ref[t] - got[t]) < 1e-4 for t in ref)
