"""Structured outputs that start after the reasoning (``StructuredOutputsParams.start_after_token_ids``):
free tokens until the start sequence, the grammar after it; with speculative decoding, per-draft masks
on both sides of the start and the speculator's draft cut, and the engine's output token for token the
plain run's."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leaks
from test_spec_decode_structured import NGRAM, SETTINGS, SUFFIX, mask_of, propose
from transformers import AutoTokenizer

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured import StructuredOutputManager
from pagedllm.structured.gated import GatedMatcher

CHOICES = ["Hello, world!", "The quick brown fox"]
PROMPT = "The quick brown fox jumps over the lazy dog. Hello, world! The quick brown fox"


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def manager(model):
    tokenizer = AutoTokenizer.from_pretrained(model)
    return tokenizer, StructuredOutputManager(tokenizer, len(tokenizer))


def free_run(model: str) -> list[int]:
    llm = LLM(model=model, **SETTINGS)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return list(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)


def first_new_token(tokens: list[int]) -> int:
    """The first position (from 2) whose token did not occur before: a start sequence met there first."""
    return next(k for k in range(2, len(tokens)) if tokens[k] not in tokens[:k])


def test_params_validation():
    with pytest.raises(ValueError, match="start_after_token_ids"):
        StructuredOutputsParams(regex="a", start_after_token_ids=[])
    with pytest.raises(ValueError, match="start_after_token_ids"):
        StructuredOutputsParams(regex="a", start_after_token_ids=[-1])
    assert StructuredOutputsParams(regex="a", start_after_token_ids=(3, 4)).start_after_token_ids == [3, 4]


def test_new_matcher_is_gated_and_masks_per_draft_across_the_start(manager):
    tokenizer, structured = manager
    plain_spec = StructuredOutputsParams(choice=CHOICES)
    start = tokenizer.encode("dog.", add_special_tokens=False)
    gated = structured.new_matcher(StructuredOutputsParams(choice=CHOICES, start_after_token_ids=start))
    assert isinstance(gated, GatedMatcher)
    free = tokenizer.encode("lazy ", add_special_tokens=False)
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    drafts = free + start + hello
    bitmask, alive, failed = structured.fill_bitmasks([gated], [drafts])
    assert not failed and all(alive)
    first_constrained = len(free) + len(start)
    assert bool((bitmask[:first_constrained] == -1).all())  # free rows: everything allowed
    for j in range(first_constrained, len(drafts) + 1):  # then the grammar's state after the drafts since the start
        reference = structured.new_matcher(plain_spec)
        assert all(reference.accept_token(t) for t in drafts[first_constrained:j])
        assert torch.equal(bitmask[j], mask_of(structured, reference)), j
    assert not gated.started and gated.free_token_ids == []  # rolled back
    # The speculator's cut: free drafts pass, the grammar cuts after the start.
    x = tokenizer.encode("x", add_special_tokens=False)
    assert propose(gated, drafts, len(drafts)) == drafts
    assert propose(gated, free + start + x, len(drafts)) == free + start
    assert not gated.started


def test_engine_constrains_only_after_the_start(model):
    reference = free_run(model)
    k = first_new_token(reference)
    start = reference[k : k + 1]
    llm = LLM(model=model, **SETTINGS)
    tokenizer = llm.get_tokenizer()
    spec = StructuredOutputsParams(choice=CHOICES, start_after_token_ids=start)
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec)
    completion = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    tokens = list(completion.token_ids)
    assert tokens[: k + 1] == reference[: k + 1]  # the free part is the model's own greedy text
    answer = tokenizer.decode(tokens[k + 1 :], skip_special_tokens=True)
    assert answer in CHOICES and completion.finish_reason == "stop", (answer, completion)
    # Never generated: the constraint never starts, the reply is free.
    never = StructuredOutputsParams(choice=CHOICES, start_after_token_ids=[len(tokenizer) - 1] * 3)
    free = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, structured_outputs=never),
        use_tqdm=False,
    )[0].outputs[0]
    assert list(free.token_ids) == reference
    assert_no_leaks(llm)


@pytest.mark.parametrize("config", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_speculative_decoding_keeps_the_start(model, config):
    reference = free_run(model)
    k = first_new_token(reference)
    requests = [
        SamplingParams(
            temperature=t,
            seed=3,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(choice=CHOICES, start_after_token_ids=reference[k : k + 1]),
        )
        for t in (0.0, 0.8)
    ]
    plain = LLM(model=model, **SETTINGS).generate([PROMPT] * 2, requests, use_tqdm=False)
    llm = LLM(model=model, speculative_config=config, **SETTINGS)
    got = llm.generate([PROMPT] * 2, requests, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == [list(o.outputs[0].token_ids) for o in plain]
    assert llm.llm_engine.get_stats()["spec_decode_num_draft_tokens"] > 0
    assert_no_leaks(llm)


def test_optional_opening_masks_the_grammar_or_the_opening(manager):
    tokenizer, structured = manager
    opening = len(tokenizer) - 1  # any token the grammar never allows first
    spec = StructuredOutputsParams(choice=CHOICES, start_after_token_ids=[5], optional_open_token_id=opening)
    gated = structured.new_matcher(spec)
    plain = mask_of(structured, structured.new_matcher(StructuredOutputsParams(choice=CHOICES)))
    undecided = mask_of(structured, gated)
    word, bit = divmod(opening, 32)
    assert not (int(plain[word]) >> bit) & 1 and (int(undecided[word]) >> bit) & 1
    undecided[word] = plain[word]
    assert torch.equal(undecided, plain)  # otherwise the grammar's own first tokens
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    assert all(gated.accept_token(t) for t in hello) and gated.started_at_once
    gated.rollback(len(hello))
    assert gated.undecided and gated.accept_token(opening) and not gated.started
    assert bool((mask_of(structured, gated) == -1).all())
