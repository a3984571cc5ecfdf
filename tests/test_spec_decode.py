"""Speculative decoding: exact greedy and seeded output, rejection sampling's distribution, block rollback.

The proposers under test are the real ones (n-gram, suffix) on prompts that repeat themselves, and
an oracle that knows the plain run's continuation and corrupts it at seeded random positions: every
accept pattern (none, some, all of a draft) occurs, with preemption, prefix-cache hits and parallel
samples sharing blocks, and the output must be the plain run's token for token with no block leaked.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import assert_no_leaks

from pagedllm import LLM, SamplingParams
from pagedllm.config import SpeculativeConfig

SETTINGS = dict(block_size=4, num_kv_blocks=96, device="cpu", dtype="float32", num_threads=1,
                int8_activations=False)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def repeating_prompts() -> list[list[int]]:
    rng = random.Random(0)
    prompts = []
    for length in (5, 9, 14):
        motif = [rng.randrange(10, 380) for _ in range(length)]
        prompts.append((motif * 3)[: 2 * length + 3])
    prompts.append([rng.randrange(10, 380) for _ in range(23)])
    return prompts


def run(llm: LLM, prompts, params) -> list[list[list[int]]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[list(c.token_ids) for c in out.outputs] for out in outputs]


class OracleProposer:
    """Proposes the known continuation, each draft token replaced by a wrong one with probability
    ``corrupt`` and the draft cut to a random length: accept patterns of every kind."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], corrupt: float, seed: int) -> None:
        self.continuations = continuations
        self.corrupt = corrupt
        self.rng = random.Random(seed)
        self.finished: list[str] = []

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        for prompt, continuation in self.continuations.items():
            if tuple(token_ids[: len(prompt)]) == prompt and len(token_ids) >= len(prompt):
                done = len(token_ids) - len(prompt)
                draft = continuation[done : done + self.rng.randint(0, max_tokens)]
                return [t if self.rng.random() > self.corrupt else (t + 1) % 384 for t in draft]
        return []

    def request_finished(self, request_id: str, token_ids: list[int], prompt_len: int) -> None:
        self.finished.append(request_id)


def with_proposer(llm: LLM, proposer) -> LLM:
    llm.llm_engine.scheduler.speculator.proposer = proposer
    return llm


def spec_stats(llm: LLM) -> dict:
    return {k: v for k, v in llm.llm_engine.get_stats().items() if k.startswith("spec_decode")}


@pytest.mark.parametrize("config", [NGRAM, {"method": "suffix", "num_speculative_tokens": 6}], ids=["ngram", "suffix"])
def test_greedy_output_is_the_plain_output(tiny_model_factory, config) -> None:
    model = tiny_model_factory("llama")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    prompts = repeating_prompts()
    plain = LLM(model=model, **SETTINGS)
    spec = LLM(model=model, speculative_config=config, **SETTINGS)
    expected = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for want, have in zip(expected, got):
        assert list(have.outputs[0].token_ids) == list(want.outputs[0].token_ids)
        # Logprobs of accepted tokens are the target model's, as in plain decoding.
        for a, b in zip(want.outputs[0].logprobs, have.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(math.isclose(a[t], b[t], rel_tol=1e-4, abs_tol=1e-4) for t in a)
    stats = spec_stats(spec)
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_accepted_tokens"]
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == stats["spec_decode_num_accepted_tokens"]
    assert_no_leaks(spec)


@pytest.mark.parametrize("corrupt", [0.0, 0.3, 1.0])
def test_every_accept_pattern_keeps_output_and_blocks(tiny_model_factory, corrupt) -> None:
    """A tight pool (preemption by recompute), shared prefixes (prefix-cache hits) and drafts that
    cross block boundaries; rejected drafts' blocks go back to the pool."""
    model = tiny_model_factory("llama")
    rng = random.Random(1)
    shared = [rng.randrange(10, 380) for _ in range(9)]
    prompts = [shared + [rng.randrange(10, 380) for _ in range(n)] for n in (1, 4, 7, 11, 2, 6)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    tight = dict(SETTINGS, num_kv_blocks=28)
    plain = run(LLM(model=model, **tight), prompts, params)
    continuations = {tuple(p): out[0] for p, out in zip(prompts, plain)}
    llm = with_proposer(LLM(model=model, speculative_config=NGRAM, **tight),
                        OracleProposer(continuations, corrupt, seed=7))
    assert run(llm, prompts, params) == plain
    stats = spec_stats(llm)
    if corrupt < 1.0:
        assert stats["spec_decode_num_accepted_tokens"] > 0
    assert llm.llm_engine.get_stats()["num_preempted"] > 0  # the pool really was the bottleneck
    assert_no_leaks(llm)


def test_seeded_sampling_is_the_plain_runs(tiny_model_factory) -> None:
    """Draws of rows after a rejected draft are taken back: a seeded request samples the same tokens
    with or without speculation."""
    model = tiny_model_factory("llama")
    prompts = repeating_prompts()
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, ignore_eos=True, seed=11 + i)
              for i in range(len(prompts))]
    plain = run(LLM(model=model, **SETTINGS), prompts, params)
    continuations = {tuple(p): out[0] for p, out in zip(prompts, plain)}
    llm = with_proposer(LLM(model=model, speculative_config=NGRAM, **SETTINGS),
                        OracleProposer(continuations, 0.3, seed=3))
    assert run(llm, prompts, params) == plain
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    assert_no_leaks(llm)


def test_parallel_samples_share_blocks_and_stay_reproducible(tiny_model_factory) -> None:
    """n = 3 forks share the prompt's blocks; each speculates on its own, writes its drafts after a
    copy-on-write of the shared last block, and a rerun gives the same samples."""
    model = tiny_model_factory("llama")
    prompts = repeating_prompts()[:2]
    params = SamplingParams(n=3, temperature=0.7, max_tokens=20, ignore_eos=True, seed=5)
    first = run(LLM(model=model, speculative_config=NGRAM, **SETTINGS), prompts, params)
    llm = LLM(model=model, speculative_config=NGRAM, **SETTINGS)
    assert run(llm, prompts, params) == first
    assert all(len(c) == 20 for out in first for c in out)
    assert llm.llm_engine.scheduler.block_manager.num_cow_copies > 0
    assert_no_leaks(llm)


def test_rejection_sampling_keeps_the_target_distribution(tiny_model_factory) -> None:
    """Unseeded requests (no rewinding) whose first token is the likeliest one, a, get the draft d,
    the likeliest token after a: the token verified after a must follow the target's distribution
    p(. | prompt, a) whether d was kept or not, and the token after a kept d p(. | prompt, a, d)
    (chi-square against transformers' probabilities)."""
    from transformers import AutoModelForCausalLM

    model = tiny_model_factory("llama")
    prompt = repeating_prompts()[2]
    temperature = 0.5  # peaked enough that a and d are frequent and many bins are well filled
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)

    def probs(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(hf(torch.tensor([tokens])).logits[0, -1].double() / temperature, -1)

    a = int(probs(prompt).argmax())
    after_a = probs(prompt + [a])
    d = int(after_a.argmax())
    after_d = probs(prompt + [a, d])

    class FixedDraft:
        def propose(self, request_id, token_ids, max_tokens):
            return [d] if len(token_ids) == len(prompt) + 1 and token_ids[-1] == a else []

        def request_finished(self, request_id, token_ids, prompt_len):
            pass

    llm = with_proposer(LLM(model=model, speculative_config=NGRAM, seed=123, **SETTINGS), FixedDraft())
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True)
    samples = [out[0] for out in run(llm, [prompt] * 1200, params)]
    second = [s[1] for s in samples if s[0] == a]
    third = [s[2] for s in samples if s[0] == a and s[1] == d]
    # Drafts are dropped in steps where the pool has no room for them, so not every request speculated.
    assert 50 < spec_stats(llm)["spec_decode_num_accepted_tokens"] <= len(third)
    assert chi_square_z(second, after_a) < 3.5
    assert chi_square_z(third, after_d) < 3.5
    assert_no_leaks(llm)


def chi_square_z(tokens: list[int], probs: torch.Tensor) -> float:
    """How many standard deviations the chi-square statistic of ``tokens`` against ``probs`` lies
    above its mean (Wilson-Hilferty), bins with an expected count under 5 pooled."""
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs * len(tokens)
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    expected = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    dof = observed.numel() - 1
    assert dof >= 3, "too few well-filled bins for the test to mean anything"
    return ((chi2 / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))


def test_speculation_switches_off(tiny_model_factory) -> None:
    model = tiny_model_factory("llama")
    prompts = repeating_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    # Above the batch size limit nothing is proposed.
    busy = LLM(model=model, speculative_config=dict(NGRAM, disable_by_batch_size=2), **SETTINGS)
    run(busy, prompts, params)
    drafts_at_load = spec_stats(busy)["spec_decode_num_drafts"]
    alone = LLM(model=model, speculative_config=dict(NGRAM, disable_by_batch_size=2), **SETTINGS)
    run(alone, prompts[:1], params)
    assert spec_stats(alone)["spec_decode_num_drafts"] > 0
    assert drafts_at_load < spec_stats(alone)["spec_decode_num_drafts"] * len(prompts)
    # A request whose drafts are always wrong stops speculating.
    plain = run(LLM(model=model, **SETTINGS), prompts, params)
    llm = with_proposer(
        LLM(model=model, speculative_config=dict(NGRAM, min_request_drafts=8, min_request_acceptance=0.5), **SETTINGS),
        OracleProposer({tuple(p): out[0] for p, out in zip(prompts, plain)}, 1.0, seed=0))
    assert run(llm, prompts, params) == plain
    stats = spec_stats(llm)
    assert stats["spec_decode_requests_switched_off"] == len(prompts)
    assert stats["spec_decode_num_draft_tokens"] < len(prompts) * 16
    assert_no_leaks(llm)


def test_speculative_config_errors() -> None:
    assert SpeculativeConfig.parse('{"method": "ngram", "prompt_lookup_max": 1}').prompt_lookup_min == 1
    with pytest.raises(ValueError, match="unknown keys: bogus"):
        SpeculativeConfig.parse({"method": "ngram", "bogus": 1})
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.parse("{method")
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be in \[1, 64\], got 0"):
        SpeculativeConfig.parse({"num_speculative_tokens": 0})


@pytest.mark.parametrize("value, message", [
    ({"num_speculative_tokens": "3"}, r"num_speculative_tokens must be int, got '3' \(str\)"),
    ({"num_speculative_tokens": True}, r"num_speculative_tokens must be int, got True \(bool\)"),
    ({"num_speculative_tokens": 3.0}, r"num_speculative_tokens must be int, got 3.0"),
    ({"num_speculative_tokens": 10**6}, r"num_speculative_tokens must be in \[1, 64\], got 1000000"),
    ({"prompt_lookup_max": "4"}, r"prompt_lookup_max must be int, got '4'"),
    ({"disable_by_batch_size": "8"}, r"disable_by_batch_size must be int or null"),
    ({"min_request_acceptance": "0.5"}, r"min_request_acceptance must be float"),
    ({"method": 1}, r"method must be str, got 1"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, r"suffix_decoding_max_tree_depth must be >= 1"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, r"suffix_decoding_min_token_prob must be in \[0, 1\]"),
    ({"method": "draft_model", "model": "/no/such/draft"}, r"model: the draft model path '/no/such/draft' does not"),
    ({"model": 7}, r"model must be str or null, got 7"),
])
def test_speculative_config_values_are_refused_by_field(value, message) -> None:
    with pytest.raises(ValueError, match="speculative_config " + message):
        SpeculativeConfig.parse(value)


def test_speculative_config_keeps_what_json_gives() -> None:
    assert SpeculativeConfig.parse({"num_speculative_tokens": 64}).num_speculative_tokens == 64
    # JSON's 0 is an int: a float field takes it as 0.0.
    assert SpeculativeConfig.parse({"min_request_acceptance": 0}).min_request_acceptance == 0.0
    # A hub id is fetched when the engine starts, so it is not checked here.
    assert SpeculativeConfig.parse({"model": "org/draft"}).model == "org/draft"


def test_metrics_carry_the_spec_decode_counters(tiny_model_factory) -> None:
    from pagedllm.entrypoints.openai.metrics import ServerMetrics

    llm = LLM(model=tiny_model_factory("llama"), speculative_config=NGRAM, **SETTINGS)
    run(llm, repeating_prompts(), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    stats = llm.llm_engine.get_stats()
    metrics = ServerMetrics("tiny")
    metrics.update_stats(stats)
    text = metrics.render().decode()
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert f'pagedllm:spec_decode_{key}_total{{model_name="tiny"}} {float(stats["spec_decode_" + key])}' in text
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == NGRAM["num_speculative_tokens"] and per_pos[0] > 0
    assert f'pagedllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="0"}} ' \
           f'{float(per_pos[0])}' in text
    plain = ServerMetrics("tiny")
    plain.update_stats(LLM(model=tiny_model_factory("llama"), **SETTINGS).llm_engine.get_stats())
    assert "spec_decode" not in plain.render().decode()


def test_command_line_flag_reaches_the_engine_args() -> None:
    import argparse

    from pagedllm.entrypoints.engine_flags import add_engine_args, engine_args_from_cli

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from_cli(parser.parse_args(
        ["--speculative-config", '{"method": "suffix", "num_speculative_tokens": 8}']))
    assert args.speculative_config == SpeculativeConfig(method="suffix", num_speculative_tokens=8)
    assert engine_args_from_cli(parser.parse_args([])).speculative_config is None
    with pytest.raises(ValueError, match="not valid JSON"):
        engine_args_from_cli(parser.parse_args(["--speculative-config", "ngram"]))
