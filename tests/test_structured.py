"""Structured outputs in the engine: JSON schema, regex, choice and grammar constraints through
xgrammar, with greedy decoding, sampling, parallel samples and beam search; bad constraints; a
constraint nothing can satisfy; constrained and free requests in one batch."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from conftest import assert_no_leaks
from requirements_here import require_kernels

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import GuidedDecodingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "word": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                   "ok": {"type": "boolean"}},
    "required": ["id", "word", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["The quick brown fox", "Hello, world!", "A block table maps", "def main():"]


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(tiny_model_factory("llama"), num_kv_blocks=128, device="cpu", dtype="float32", num_threads=1)


def texts(outputs) -> list[str]:
    return [c.text for o in outputs for c in o.outputs]


def test_json_schema_greedy_sampled_n4_and_beam(llm):
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    runs = [
        SamplingParams(max_tokens=80, temperature=0, structured_outputs=spec),
        SamplingParams(max_tokens=80, temperature=1.0, n=4, seed=3, structured_outputs=spec),
        SamplingParams(max_tokens=80, use_beam_search=True, best_of=3, n=2, structured_outputs=spec),
    ]
    for params in runs:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        for output in outputs:
            for completion in output.outputs:
                assert completion.finish_reason == "stop", completion
                jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert_no_leaks(llm)


def test_regex_choice_grammar_every_sample(llm):
    params = SamplingParams(n=4, max_tokens=20, temperature=1.5, seed=7,
                            structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-(yes|no)"))
    for text in texts(llm.generate(PROMPTS[:2], params, use_tqdm=False)):
        assert re.fullmatch(r"[0-9]{3}-(yes|no)", text), text
    choices = ["red", "green", 'say "blue"', "чёрный"]
    params = SamplingParams(n=4, max_tokens=20, temperature=1.5, seed=1,
                            guided_decoding=GuidedDecodingParams(choice=choices))  # vLLM's older name
    assert params.structured_outputs.choice == choices
    for text in texts(llm.generate(PROMPTS[:2], params, use_tqdm=False)):
        assert text in choices
    grammar = 'root ::= "(" [a-c] [a-c]? [a-c]? ")"'
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=2, structured_outputs=StructuredOutputsParams(
        grammar=grammar))
    for text in texts(llm.generate(PROMPTS, params, use_tqdm=False)):
        assert re.fullmatch(r"\([a-c]{1,3}\)", text), text
    assert_no_leaks(llm)


def test_constrained_and_free_requests_share_a_batch(llm):
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = texts(llm.generate(PROMPTS, free, use_tqdm=False))
    constrained = SamplingParams(max_tokens=12, temperature=0, structured_outputs=StructuredOutputsParams(
        regex="[a-z]+"))
    mixed = llm.generate(PROMPTS + PROMPTS, [free] * 4 + [constrained] * 4, use_tqdm=False)
    assert texts(mixed[:4]) == alone  # the masks of other rows change nothing here
    for text in texts(mixed[4:]):
        assert re.fullmatch("[a-z]+", text), text
    stats = llm.llm_engine.get_stats()
    assert stats["grammar_cache_hits"] >= 3  # one compile for the four constrained requests
    assert stats["grammar_mask_rows"] > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("spec, message", [
    (dict(json='{"type": "object", "properties": {'), "not valid JSON"),
    (dict(json={"type": 5}), "Type should be a string"),
    (dict(json={"type": "string", "minLength": 5, "maxLength": 2}), "minLength 5 is greater than maxLength 2"),
    (dict(json="false"), "cannot accept any value"),
    (dict(json={"enum": []}), "enum array must not be empty"),
    (dict(regex="[a-"), "Unclosed '['"),
    (dict(grammar='root ::= "a" |'), "EBNF parser error"),
    (dict(grammar="other ::= [a-z]"), "root"),
])
def test_bad_constraints_raise_naming_the_problem(llm, spec, message):
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate("hi", params, use_tqdm=False)
    assert_no_leaks(llm)


def test_params_validation():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="disagree"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"),
                       guided_decoding=StructuredOutputsParams(regex="b"))


def test_grammar_without_a_finite_sentence_ends_at_max_tokens(llm):
    # Compiles, but every sentence is infinite: the output runs to max_tokens and ends ("length").
    spec = StructuredOutputsParams(grammar='root ::= "a" tail\ntail ::= "x" tail')
    outputs = llm.generate(["hello"], SamplingParams(max_tokens=30, temperature=0, structured_outputs=spec),
                           use_tqdm=False)
    completion = outputs[0].outputs[0]
    assert completion.finish_reason == "length" and re.fullmatch("ax+", completion.text)
    assert_no_leaks(llm)


def test_a_grammar_with_no_first_token_aborts(llm, monkeypatch):
    manager = llm.llm_engine.structured_outputs
    real_fill = manager.fill_bitmasks

    def nothing_allowed(matchers):
        bitmask, alive, failed = real_fill(matchers)
        bitmask.zero_()
        return bitmask, [False] * len(alive), failed

    monkeypatch.setattr(manager, "fill_bitmasks", nothing_allowed)
    params = SamplingParams(n=2, max_tokens=10, temperature=1.0, structured_outputs=StructuredOutputsParams(
        regex="[a-z]+"))
    outputs = llm.generate(["hello", "world"], params, use_tqdm=False)
    for completion in outputs[0].outputs + outputs[1].outputs:
        assert completion.finish_reason == "abort"
        assert completion.stop_reason == "structured output: no token can continue the grammar"
    assert_no_leaks(llm)


def test_huge_schema_compiles_and_is_cached(llm):
    properties = {f"field_{i}": {"type": "integer"} for i in range(400)}
    schema = {"type": "object", "properties": properties, "required": ["field_0"]}
    params = SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(json=schema))
    before = llm.llm_engine.get_stats()["grammar_cache_misses"]
    llm.generate(["a", "b"], params, use_tqdm=False)
    # The same schema with other spacing: one compile.
    params2 = SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(
        json=json.dumps(schema, indent=2)))
    outputs = llm.generate(["c"], params2, use_tqdm=False)
    assert outputs[0].outputs[0].text.startswith("{")
    assert llm.llm_engine.get_stats()["grammar_cache_misses"] == before + 1
    assert_no_leaks(llm)


def test_bitmask_kernel_equals_xgrammars():
    """Our CPU masking kernel forbids exactly what xgrammar's does: random words, zero words, full words,
    a vocabulary that ends inside a word, unconstrained rows left alone."""
    import xgrammar as xgr

    from pagedllm.structured.bitmask import apply_token_bitmask

    vocab = 1000  # 31.25 words
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=gen)
    masks = torch.randint(-2**31, 2**31 - 1, (5, 32), dtype=torch.int32, generator=gen)
    masks[1] = 0
    masks[1, 3] = 0x0F0F
    masks[2] = -1
    expected = logits[[0, 1, 2, 4]].clone()
    xgr.apply_token_bitmask_inplace(expected, masks[[0, 1, 2, 4]].contiguous(), vocab_size=vocab)
    got = logits.clone()
    apply_token_bitmask(got, [masks[0], masks[1], masks[2], None, masks[4]])
    torch.testing.assert_close(got[[0, 1, 2, 4]], expected, rtol=0, atol=0)
    torch.testing.assert_close(got[3], logits[3], rtol=0, atol=0)


def test_masked_greedy_kernel_equals_masking_then_argmax():
    """Greedy choice under bitmasks without masking: the argmax (first of ties) and log_softmax of the masked
    logits, on random words, runs of full words, zero words, a tie whose first maximum is forbidden, a
    vocabulary ending inside a word, an unconstrained row; a row allowing nothing gets token -1."""
    from pagedllm.structured.bitmask import apply_token_bitmask, greedy_pick_masked

    require_kernels()
    vocab = 1000  # 31.25 words
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, vocab, generator=gen) * 4
    masks = torch.randint(-2**31, 2**31 - 1, (7, 32), dtype=torch.int32, generator=gen)
    masks[1] = 0
    masks[1, 3] = 0x0F0F
    masks[2, 4:20] = -1  # a run of whole allowed words
    logits[4, [5, 40, 70]] = 50.0  # tied maxima: token 5 is forbidden, 40 and 70 allowed
    masks[4] = 0
    masks[4, 1] = 1 << 8
    masks[4, 2] = 1 << 6
    masks[5] = 0
    masks[5, 31] = 1 << 7  # only token 999, in the last, partial word
    rows = [masks[0], masks[1], masks[2], None, masks[4], masks[5], masks[6]]
    ids, logprobs = greedy_pick_masked(logits, rows)
    masked = logits.clone()
    apply_token_bitmask(masked, rows)
    assert torch.equal(ids, masked.argmax(dim=-1))
    assert ids[4] == 40 and ids[5] == 999
    expected = torch.log_softmax(masked, dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-5)
    nothing = torch.zeros(32, dtype=torch.int32)
    ids, logprobs = greedy_pick_masked(logits[:1].clone(), [nothing])
    assert ids.tolist() == [-1] and logprobs.tolist() == [float("-inf")]


def test_a_raising_matcher_fails_only_its_request(llm, monkeypatch):
    """Bitmasks are filled for the whole batch at once; a matcher that raises there fails its own request."""
    manager = llm.llm_engine.structured_outputs
    real_new_matcher = manager.new_matcher

    class Broken:
        def __init__(self, matcher):
            self.matcher = matcher

        def fill_next_token_bitmask(self, bitmask, index):
            raise RuntimeError("broken matcher")

        def __getattr__(self, name):
            return getattr(self.matcher, name)

    def new_matcher(spec):
        matcher = real_new_matcher(spec)
        return Broken(matcher) if spec.regex == "b+" else matcher

    monkeypatch.setattr(manager, "new_matcher", new_matcher)
    params = [SamplingParams(max_tokens=6, temperature=0, structured_outputs=StructuredOutputsParams(regex=regex))
              for regex in ("a+", "b+", "[0-9]+")]
    ok_a, broken, ok_digits = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert broken.failed and "preparing its step" in broken.error
    assert ok_a.error is None and re.fullmatch("a+", ok_a.outputs[0].text)
    assert ok_digits.error is None and re.fullmatch("[0-9]+", ok_digits.outputs[0].text)
    assert_no_leaks(llm)
