"""Reported ranks are ranks in the whole vocabulary (vLLM's rule): 1 + the number of tokens with a
strictly higher logprob, for prompt tokens (prompt_logprobs) and sampled tokens (logprobs) alike,
whether or not the token is among the top k returned; checked against transformers' logits."""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import assert_no_leaks

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.serving_completion import vllm_prompt_logprobs
from pagedllm.sampling.logprob_rank import RankedLogprob

SETTINGS = dict(num_kv_blocks=64, device="cpu", dtype="float32", num_threads=1, int8_activations=False)
# Our logits and transformers' agree to about 1e-5; a token whose logprob is this close to another's
# may rank on either side of it.
TIE = 1e-4


def hf_logprobs(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, V]: row i is the distribution over token i + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_vocab_rank(rank: int, row: torch.Tensor, token_id: int) -> None:
    own = row[token_id].item()
    assert 1 + int((row > own + TIE).sum()) <= rank <= 1 + int((row > own - TIE).sum())


def test_prompt_and_sample_ranks_are_ranks_in_the_vocabulary(tiny_model_factory) -> None:
    model = tiny_model_factory("llama")
    llm = LLM(model=model, **SETTINGS)
    prompt = [5, 17, 230, 41, 99, 7, 300, 12, 64, 150, 33, 8]
    ranks_seen = []
    for top_k in (0, 2):
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, prompt_logprobs=top_k,
                                logprobs=top_k)
        output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        completion = output.outputs[0]
        sequence = prompt + list(completion.token_ids)
        expected = hf_logprobs(model, sequence)
        assert output.prompt_logprobs[0] is None
        entries = list(zip(output.prompt_logprobs[1:], prompt[1:], expected[: len(prompt) - 1]))
        entries += zip(completion.logprobs, completion.token_ids, expected[len(prompt) - 1:])
        for entry, token_id, row in entries:
            own = entry[token_id]
            assert isinstance(own, RankedLogprob) and own == pytest.approx(row[token_id].item(), abs=TIE)
            assert_vocab_rank(own.rank, row, token_id)
            ranks_seen.append(own.rank)
            # The top k entries: ranks 1..k in order of logprob (the token itself, if among them, too).
            assert [v.rank for v in sorted(entry.values(), reverse=True)[:top_k]] == list(range(1, top_k + 1))
    # A random model's prompt tokens are mostly not its likeliest: ranks well past the top k occur.
    assert max(ranks_seen) > 10
    # Beam search reports its tokens' logprobs by the same rule.
    beams = SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=6, ignore_eos=True, logprobs=1)
    for completion in llm.generate([{"prompt_token_ids": prompt}], beams, use_tqdm=False)[0].outputs:
        expected = hf_logprobs(model, prompt + list(completion.token_ids))[len(prompt) - 1:]
        for entry, token_id, row in zip(completion.logprobs, completion.token_ids, expected, strict=True):
            assert_vocab_rank(entry[token_id].rank, row, token_id)
            assert [v.rank for v in sorted(entry.values(), reverse=True)][:1] == [1]
    assert_no_leaks(llm)


def test_the_server_reports_the_engine_rank() -> None:
    class Context:
        @staticmethod
        def token_text(token_id: int) -> str:
            return f"t{token_id}"

    entries = [None, {7: RankedLogprob(-6.0, 120)}, {9: RankedLogprob(-0.5, 1), 4: RankedLogprob(-2.0, 2)},
               {9: RankedLogprob(-3.0, 5), 1: RankedLogprob(-0.1, 1), 2: RankedLogprob(-1.0, 2)}]
    reported = vllm_prompt_logprobs(Context(), [3, 7, 9, 9], entries)
    assert reported[0] is None
    assert reported[1] == {"7": {"logprob": -6.0, "rank": 120, "decoded_token": "t7"}}
    assert {k: v["rank"] for k, v in reported[2].items()} == {"9": 1, "4": 2}
    assert {k: v["rank"] for k, v in reported[3].items()} == {"9": 5, "1": 1, "2": 2}


def test_a_ranked_logprob_is_a_float_that_keeps_its_rank_across_processes() -> None:
    value = RankedLogprob(-1.25, 7)
    copy = pickle.loads(pickle.dumps(value))
    assert copy == -1.25 and copy.rank == 7 and f"{copy}" == "-1.25" and float(copy) + 1 == -0.25
