"""Beam search in the engine equals Hugging Face ``generate(num_beams=k, do_sample=False)``.

Same returned sequences in the same order, for beam widths 2 and 4, with and without a length
penalty, for each ``early_stopping`` mode, including hypotheses that end on an EOS token. The tiny
random model rarely produces its real EOS, so a token it does produce is made an EOS: for us a
stop token (``stop_token_ids``), for HF an entry of ``eos_token_id`` (both are HF's "list of EOS
ids", which also widens the candidate pool from 2k to (1 + #eos) * k).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import assert_no_leaks

from pagedllm import LLM, SamplingParams

# A token the tiny Llama (seed 0) emits often in the first few steps for these prompts.
EOS_LIKE = 265
MAX_NEW = 12


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, 384) for _ in range(length)] for length in (3, 7, 12)]


def _trim(generated: list[int], eos_ids: list[int]) -> list[int]:
    """HF pads hypotheses shorter than the longest after their EOS; ours end at it."""
    for i, token in enumerate(generated):
        if token in eos_ids:
            return generated[: i + 1]
    return generated


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=llama_dir, num_kv_blocks=256, block_size=4)


def hf_beam_search(model, prompt: list[int], k: int, n: int, eos_ids: list[int], length_penalty: float,
                   early_stopping: bool | str) -> list[list[int]]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=k,
            num_return_sequences=n,
            do_sample=False,
            max_new_tokens=MAX_NEW,
            eos_token_id=eos_ids,
            pad_token_id=3,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        )
    return [_trim(row[len(prompt):], eos_ids) for row in out.tolist()]


# (beam width, n returned, length_penalty, early_stopping, the tokenizer's EOS too)
CASES = [
    (2, 2, 1.0, False, False),
    (4, 4, 1.0, False, False),
    (4, 2, 0.5, "never", False),
    (2, 1, 2.0, True, False),
    (4, 3, 0.0, False, True),
]


def _params(k: int, n: int, length_penalty: float, early_stopping, real_eos: bool) -> SamplingParams:
    return SamplingParams(
        use_beam_search=True, beam_width=k, n=n, max_tokens=MAX_NEW, length_penalty=length_penalty,
        early_stopping=early_stopping, stop_token_ids=[EOS_LIKE], ignore_eos=not real_eos,
    )


def test_beam_search_equals_transformers(llm, hf_model):
    prompts = _prompts()
    # Two prompts a case keep the (slow) reference runs few; the prompts alternate between cases.
    requests = [(prompts[(i + j) % len(prompts)], case) for i, case in enumerate(CASES) for j in range(2)]
    # Every case and prompt in one batch: beam groups of different widths step together.
    outputs = llm.generate([p for p, _ in requests], [_params(*case) for _, case in requests], use_tqdm=False)
    num_eos_hypotheses = 0
    for (prompt, (k, n, length_penalty, early_stopping, real_eos)), output in zip(requests, outputs):
        eos_ids = [2, EOS_LIKE] if real_eos else [EOS_LIKE]
        expected = hf_beam_search(hf_model, prompt, k, n, eos_ids, length_penalty, early_stopping)
        got = [c.token_ids for c in output.outputs]
        assert got == expected, (prompt, k, n, length_penalty, early_stopping)
        num_eos_hypotheses += sum(ids[-1] in eos_ids for ids in expected)
        for completion in output.outputs:
            assert completion.finish_reason == ("stop" if completion.token_ids[-1] in eos_ids else "length")
    # The comparison must cover hypotheses that end on EOS, and ones that run to max_tokens.
    assert num_eos_hypotheses >= 5
    assert any(len(c.token_ids) == MAX_NEW for o in outputs for c in o.outputs)
    assert_no_leaks(llm)


def test_beams_share_blocks_while_running(llm):
    engine = llm.llm_engine
    prompt = _prompts()[2]
    engine.add_request("beam", prompt, SamplingParams(use_beam_search=True, best_of=4, max_tokens=10, ignore_eos=True))
    max_saved = max_running = 0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.get_stats()
        max_saved = max(max_saved, stats["blocks_saved_by_sharing"])
        group = engine.scheduler.running[0] if engine.scheduler.running else None
        if group is not None:
            max_running = max(max_running, group.num_seqs())
    # Four beams over a 12-token prompt in 4-token blocks: the prompt's 3 blocks are shared.
    assert max_saved >= 3 * 3
    assert max_running <= 4 + 4  # beams plus kept hypotheses
    assert_no_leaks(llm)


def test_mixed_batch_equals_each_alone(llm):
    prompts = _prompts()
    mixed = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True),
        SamplingParams(use_beam_search=True, best_of=2, max_tokens=10, ignore_eos=True),
        SamplingParams(use_beam_search=True, best_of=4, n=2, max_tokens=10, stop_token_ids=[EOS_LIKE]),
    ]
    batch_prompts = [prompts[i % len(prompts)] for i in range(len(mixed))]

    def ids(output):
        return [c.token_ids for c in output.outputs]

    alone = [ids(llm.generate([p], params, use_tqdm=False)[0]) for p, params in zip(batch_prompts, mixed)]
    together = [ids(o) for o in llm.generate(batch_prompts, mixed, use_tqdm=False)]
    assert together == alone
    assert [len(x) for x in together] == [1, 3, 1, 2]
    assert_no_leaks(llm)


def test_beam_search_params_validation():
    assert SamplingParams(use_beam_search=True, beam_width=3).best_of == 3
    with pytest.raises(ValueError, match="disagree"):
        SamplingParams(use_beam_search=True, beam_width=3, best_of=4)
    with pytest.raises(ValueError, match="stop strings"):
        SamplingParams(use_beam_search=True, best_of=2, stop=["x"])
    with pytest.raises(ValueError, match="early_stopping"):
        SamplingParams(use_beam_search=True, best_of=2, early_stopping="sometimes")
