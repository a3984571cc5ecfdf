"""Speculative decoding of structured outputs: drafts cut to what the grammar accepts, one bitmask per
verification row, the matcher rolled back in between.

The engine tests run JSON-schema, regex and choice requests (and a free one in the same batch)
whose prompts hold the constrained text, so that the n-gram and suffix proposers find drafts; the
output must be the plain run's token for token, greedy and seeded, valid for its constraint, with
drafts proposed and accepted and no block leaked. The unit tests drive a real xgrammar matcher.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from conftest import assert_no_leaks
from transformers import AutoTokenizer

from pagedllm import LLM, SamplingParams
from pagedllm.config import SpeculativeConfig
from pagedllm.core.speculator import Speculator
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.sequence import Sequence, SequenceGroup
from pagedllm.structured import StructuredOutputManager

SETTINGS = dict(block_size=4, num_kv_blocks=96, device="cpu", dtype="float32", num_threads=1,
                int8_activations=False)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 5}

SCHEMA = {"type": "array", "items": {"type": "string", "enum": ["fox", "dog"]}, "minItems": 6, "maxItems": 6}
CHOICES = ["The quick brown fox jumps over the lazy dog.", "Hello, world!"]
FOX = r"(The quick brown fox ){1,3}"
# (prompt, constraint, whether a completion satisfies it); each prompt holds its constrained text.
CASES = [
    ("abcabcabcabc", StructuredOutputsParams(regex="(abc){2,8}"),
     lambda text: re.fullmatch("(abc){2,8}", text)),
    ("The quick brown fox jumps over the lazy dog. The quick", StructuredOutputsParams(regex=FOX),
     lambda text: re.fullmatch(FOX, text)),
    ('["fox", "dog", "fox", "dog"]', StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
     lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    ("The quick brown fox jumps over the lazy dog. Hello, world!", StructuredOutputsParams(choice=CHOICES),
     lambda text: text in CHOICES),
]
FREE_PROMPT = "A block table maps logical blocks. A block table maps logical blocks. A block"


def requests(temperature: float) -> tuple[list[str], list[SamplingParams]]:
    """The constrained cases and one free request, as one batch."""
    params = [SamplingParams(temperature=temperature, seed=11 + i, max_tokens=48, structured_outputs=spec)
              for i, (_, spec, _) in enumerate(CASES)]
    params.append(SamplingParams(temperature=temperature, seed=5, max_tokens=16, ignore_eos=True))
    return [prompt for prompt, _, _ in CASES] + [FREE_PROMPT], params


@pytest.fixture(scope="module")
def plain_outputs(tiny_model_factory):
    llm = LLM(model=tiny_model_factory("llama"), **SETTINGS)
    return {temperature: llm.generate(*requests(temperature), use_tqdm=False) for temperature in (0.0, 0.8)}


@pytest.mark.parametrize("config", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_constrained_requests_speculate_exactly(tiny_model_factory, plain_outputs, config) -> None:
    llm = LLM(model=tiny_model_factory("llama"), speculative_config=config, **SETTINGS)
    for temperature, expected in plain_outputs.items():
        got = llm.generate(*requests(temperature), use_tqdm=False)
        for (prompt, _, valid), want, have in zip(CASES, expected, got):
            completion = have.outputs[0]
            assert list(completion.token_ids) == list(want.outputs[0].token_ids), (prompt, temperature)
            assert completion.finish_reason == "stop", completion
            assert valid(completion.text), completion.text
        assert list(got[-1].outputs[0].token_ids) == list(expected[-1].outputs[0].token_ids)
    stats = llm.llm_engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0, stats
    assert 0 < stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"], stats
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == stats["spec_decode_num_accepted_tokens"]
    # Speculating constrained sequences were masked with a row per draft position.
    assert stats["grammar_mask_rows"] > stats["grammar_mask_steps"] * len(CASES)
    assert_no_leaks(llm)


def test_constrained_requests_speculate_without_the_free_one(tiny_model_factory, plain_outputs) -> None:
    """Constrained requests alone (every row masked) give the same tokens as in the mixed batch."""
    llm = LLM(model=tiny_model_factory("llama"), speculative_config=NGRAM, **SETTINGS)
    prompts, params = requests(0.0)
    got = llm.generate(prompts[:-1], params[:-1], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == [
        list(o.outputs[0].token_ids) for o in plain_outputs[0.0][:-1]]
    assert llm.llm_engine.get_stats()["spec_decode_num_accepted_tokens"] > 0
    assert_no_leaks(llm)


def test_preempted_and_forked_constrained_sequences_speculate(tiny_model_factory) -> None:
    """A pool too small for the batch (preemption by recompute: the matcher keeps its state) and
    parallel samples (each fork speculates from its own matcher): the plain run's greedy tokens,
    and valid, reproducible samples."""
    model = tiny_model_factory("llama")
    tight = dict(SETTINGS, num_kv_blocks=20)
    prompts, params = requests(0.0)
    prompts, params = prompts[:-1] * 2, params[:-1] * 2
    plain = LLM(model=model, **tight).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=model, speculative_config=NGRAM, **tight)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == [list(o.outputs[0].token_ids) for o in plain]
    stats = llm.llm_engine.get_stats()
    assert stats["num_preempted"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert_no_leaks(llm)

    samples = [SamplingParams(n=3, temperature=0.8, seed=9, max_tokens=48, structured_outputs=spec)
               for _, spec, _ in CASES]
    llm = LLM(model=model, speculative_config=NGRAM, **SETTINGS)
    first = llm.generate(prompts[: len(CASES)], samples, use_tqdm=False)
    again = llm.generate(prompts[: len(CASES)], samples, use_tqdm=False)
    for (_, _, valid), output, rerun in zip(CASES, first, again):
        assert [c.token_ids for c in output.outputs] == [c.token_ids for c in rerun.outputs]
        assert all(c.finish_reason == "stop" and valid(c.text) for c in output.outputs), output.outputs
    assert llm.llm_engine.get_stats()["spec_decode_num_accepted_tokens"] > 0
    assert_no_leaks(llm)


# ------------------------------------------------------------------------------ with a real matcher


class FixedProposer:
    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        return self.drafts[:max_tokens]

    def request_finished(self, request_id: str, token_ids: list[int], prompt_len: int) -> None:
        pass


@pytest.fixture(scope="module")
def grammar(tiny_model_factory):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_factory("llama"))
    manager = StructuredOutputManager(tokenizer, len(tokenizer))
    return tokenizer, manager


def mask_of(manager: StructuredOutputManager, matcher) -> torch.Tensor:
    bitmask, _, failed = manager.fill_bitmasks([matcher])
    assert not failed
    return bitmask[0]


def propose(matcher, drafts: list[int], num_speculative_tokens: int = 8) -> list[int]:
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": num_speculative_tokens})
    speculator = Speculator(config, max_model_len=512)
    speculator.proposer = FixedProposer(drafts)
    seq = Sequence(0, [5, 6, 7], block_size=4)
    seq.grammar = matcher
    group = SequenceGroup("r", [seq], SamplingParams(max_tokens=64))
    return speculator.propose(group, seq, budget=64)


def test_drafts_are_cut_at_the_first_token_the_grammar_refuses(grammar) -> None:
    tokenizer, manager = grammar
    spec = StructuredOutputsParams(regex="(abc)+")
    abc = tokenizer.encode("abcabc", add_special_tokens=False)
    x = tokenizer.encode("x", add_special_tokens=False)
    matcher = manager.new_matcher(spec)
    before = mask_of(manager, matcher)
    assert propose(matcher, abc) == abc  # every draft fits
    assert propose(matcher, abc[:2] + x + abc[2:]) == abc[:2]  # cut at the refused one
    assert propose(matcher, x + abc) == []
    assert propose(matcher, abc, num_speculative_tokens=3) == abc[:3]
    # The matcher is where it was: same mask, and it takes the real tokens from its own state.
    assert torch.equal(mask_of(manager, matcher), before)
    assert all(matcher.accept_token(token) for token in abc)

    # Further on: drafts are checked from the sequence's current state.
    assert propose(matcher, abc) == abc  # "abcabc" again
    assert propose(matcher, abc[1:]) == []  # "c" cannot follow "abcabc"


def test_a_draft_that_ends_the_grammar_is_cut(grammar) -> None:
    """The stop token ends the matcher: the row after it could not be masked, so it is not drafted."""
    tokenizer, manager = grammar
    matcher = manager.new_matcher(StructuredOutputsParams(choice=["Hello, world!"]))
    hello = tokenizer.encode("Hello, world!", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    assert propose(matcher, hello + [eos, eos]) == hello
    assert not matcher.is_terminated()
    assert all(matcher.accept_token(token) for token in hello)
    assert propose(matcher, [eos]) == []  # complete: the only draft left would stop it
    assert matcher.accept_token(eos) and matcher.is_terminated()
    assert propose(matcher, [eos]) == []


def test_bitmask_rows_follow_the_drafts_and_the_matcher_rolls_back(grammar) -> None:
    tokenizer, manager = grammar
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    drafts = tokenizer.encode('["fox", "d', add_special_tokens=False)  # xgrammar's compact separators are ", "
    speculating, plain = manager.new_matcher(spec), manager.new_matcher(spec)
    before = mask_of(manager, speculating)
    bitmask, alive, failed = manager.fill_bitmasks([plain, speculating], [[], drafts])
    assert bitmask.shape[0] == 1 + 1 + len(drafts) and all(alive) and not failed
    assert torch.equal(bitmask[0], before)
    for j in range(len(drafts) + 1):  # row j: the grammar's state after drafts[:j]
        reference = manager.new_matcher(spec)
        assert all(reference.accept_token(token) for token in drafts[:j])
        assert torch.equal(bitmask[1 + j], mask_of(manager, reference)), j
    assert torch.equal(mask_of(manager, speculating), before)  # rolled back

    # A draft the grammar refuses fails that matcher alone, which still ends as it began.
    refused = drafts[:2] + tokenizer.encode("x", add_special_tokens=False)
    bitmask, alive, failed = manager.fill_bitmasks([plain, speculating], [[], refused])
    assert list(failed) == [1] and alive[0]
    assert torch.equal(mask_of(manager, speculating), before)
