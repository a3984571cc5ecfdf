"""Sampler: greedy, seeded reproducibility across batches, support of top-k/top-p/min-p, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.sampling import Sampler, SamplerOutput, SamplingRow
from pagedllm.sampling.penalties import apply_top_k_top_p
from pagedllm.sampling_params import SamplingParams

VOCAB = 64
EOS = 3


def make_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=gen) * 3.0


def row(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> SamplingRow:
    return SamplingRow(params, list(prompt or [1, 2]), list(output or []), generator)


def sample(logits: torch.Tensor, rows: list[SamplingRow], seed: int = 0, **kwargs) -> SamplerOutput:
    return Sampler(EOS, logits.shape[1])(logits, rows, torch.Generator().manual_seed(seed), **kwargs)


def repeat_rows(params: SamplingParams, logits_row: torch.Tensor, count: int) -> tuple[torch.Tensor, list[SamplingRow]]:
    return logits_row.unsqueeze(0).repeat(count, 1), [row(params) for _ in range(count)]


# --- greedy -----------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_logprobs_are_log_softmax() -> None:
    logits = make_logits(8)
    out = sample(logits, [row(SamplingParams(temperature=0.0)) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    expected = torch.log_softmax(logits, dim=-1).gather(1, logits.argmax(dim=-1, keepdim=True)).squeeze(1)
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-6)
    assert out.top_logprobs == [None] * 8
    assert out.full_logprobs is None


def test_greedy_fast_path_does_not_draw_random_numbers() -> None:
    logits = make_logits(4)
    gen = torch.Generator().manual_seed(7)
    state = gen.get_state()
    Sampler(EOS, VOCAB)(logits, [row(SamplingParams(temperature=0.0)) for _ in range(4)], gen)
    assert torch.equal(gen.get_state(), state)


def test_mixed_batch_greedy_rows_still_argmax() -> None:
    logits = make_logits(6)
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=1.0) for i in range(6)]
    out = sample(logits, [row(p) for p in params])
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]


def test_empty_batch_and_row_count_mismatch() -> None:
    out = sample(torch.empty(0, VOCAB), [])
    assert out.token_ids == [] and out.logprobs == []
    with pytest.raises(ValueError):
        sample(make_logits(2), [row(SamplingParams())])


def test_padded_vocab_columns_are_never_sampled() -> None:
    logits = torch.zeros(200, VOCAB + 8)
    logits[:, VOCAB:] = 100.0  # padding columns would win everything
    out = Sampler(EOS, VOCAB)(logits, [row(SamplingParams()) for _ in range(200)], torch.Generator().manual_seed(0))
    assert max(out.token_ids) < VOCAB
    greedy = Sampler(EOS, VOCAB)(logits[:1], [row(SamplingParams(temperature=0))], torch.Generator())
    assert greedy.token_ids[0] < VOCAB


# --- seeded reproducibility -------------------------------------------------------------------------


def _seeded_run(seed: int, steps: int, others: list[SamplingParams], position: int) -> list[int]:
    """Tokens of one seeded request over ``steps`` steps, batched with ``others`` at ``position``."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.Generator().manual_seed(999)
    sampler = Sampler(EOS, VOCAB)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=seed)
    tokens: list[int] = []
    for step in range(steps):
        target_logits = make_logits(1, seed=100 + step)
        other_logits = make_logits(len(others), seed=500 + step + len(others))
        logits = torch.cat([other_logits[:position], target_logits, other_logits[position:]])
        rows = [row(p) for p in others]
        rows.insert(position, row(params, output=tokens, generator=gen))
        tokens.append(sampler(logits, rows, shared).token_ids[position])
    return tokens


def test_seeded_row_same_alone_and_in_any_batch() -> None:
    alone = _seeded_run(1234, 20, [], 0)
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, min_p=0.1, seed=5),
        SamplingParams(temperature=1.3, repetition_penalty=1.2, presence_penalty=0.5),
    ]
    assert _seeded_run(1234, 20, others, 0) == alone
    assert _seeded_run(1234, 20, others, 2) == alone
    assert _seeded_run(1234, 20, others[:1], 1) == alone
    assert len(set(alone)) > 1  # it really samples
    assert _seeded_run(4321, 20, [], 0) != alone


def test_seeded_rows_of_other_requests_use_their_own_generators() -> None:
    logits = make_logits(1).repeat(2, 1)
    p = SamplingParams(temperature=1.0, seed=3)
    out = sample(
        logits, [row(p, generator=torch.Generator().manual_seed(3)), row(p, generator=torch.Generator().manual_seed(3))]
    )
    assert out.token_ids[0] == out.token_ids[1]


# --- support of the filters --------------------------------------------------------------------------


def test_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    logits = make_logits(16)
    greedy = logits.argmax(dim=-1).tolist()
    assert sample(logits, [row(SamplingParams(top_k=1)) for _ in range(16)]).token_ids == greedy
    assert sample(logits, [row(SamplingParams(top_p=1e-6)) for _ in range(16)]).token_ids == greedy
    assert sample(logits, [row(SamplingParams(min_p=1.0)) for _ in range(16)]).token_ids == greedy


def test_token_outside_top_k_never_sampled() -> None:
    base = make_logits(1, seed=3)[0] / 3.0  # fairly flat distribution
    logits, rows = repeat_rows(SamplingParams(top_k=5), base, 4000)
    drawn = set(sample(logits, rows).token_ids)
    allowed = set(base.topk(5).indices.tolist())
    assert drawn == allowed  # every allowed token shows up in 4000 draws, nothing else


def test_top_p_support_is_the_nucleus() -> None:
    base = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
    probs = base.softmax(-1)
    top_p = 0.8
    cumulative = probs.cumsum(-1)
    nucleus_size = int((cumulative < top_p).sum()) + 1  # smallest prefix with mass >= p
    logits, rows = repeat_rows(SamplingParams(top_p=top_p), base, 4000)
    drawn = set(sample(logits, rows).token_ids)
    assert drawn == set(range(nucleus_size))


def test_min_p_support() -> None:
    base = torch.tensor([2.0, 1.9, 1.0, 0.0, -1.0, -3.0])
    probs = base.softmax(-1)
    min_p = 0.3
    allowed = {i for i in range(6) if probs[i] >= min_p * probs.max()}
    logits, rows = repeat_rows(SamplingParams(min_p=min_p), base, 4000)
    assert set(sample(logits, rows).token_ids) == allowed


def test_top_k_then_top_p_renormalises() -> None:
    # After top_k=2 the two survivors have probabilities ~0.62 / 0.38; top_p=0.6 keeps only the first.
    base = torch.tensor([1.0, 0.5, 0.4, 0.3, 0.2, 0.1])
    logits, rows = repeat_rows(SamplingParams(top_k=2, top_p=0.6), base, 500)
    assert set(sample(logits, rows).token_ids) == {0}


def test_top_p_one_keeps_everything_despite_rounding() -> None:
    logits = torch.tensor([[50.0] + [0.0] * 9])  # cumulative sum hits 1.0 after the first token
    masked = apply_top_k_top_p(logits, None, torch.tensor([1.0]))
    assert torch.isfinite(masked).all()


def test_sampling_frequencies_follow_softmax_with_temperature() -> None:
    base = torch.tensor([1.0, 0.0, -0.5, 0.5])
    for temperature in (1.0, 0.5, 2.0):
        logits, rows = repeat_rows(SamplingParams(temperature=temperature), base, 20000)
        counts = torch.bincount(torch.tensor(sample(logits, rows, seed=11).token_ids), minlength=4).float()
        expected = (base / temperature).softmax(-1)
        assert torch.allclose(counts / counts.sum(), expected, atol=0.015), (temperature, counts / counts.sum())


def test_shared_generator_makes_unseeded_batches_reproducible() -> None:
    logits = make_logits(32)
    rows = [row(SamplingParams()) for _ in range(32)]
    assert sample(logits, rows, seed=5).token_ids == sample(logits, rows, seed=5).token_ids
    assert sample(logits, rows, seed=5).token_ids != sample(logits, rows, seed=6).token_ids


@settings(max_examples=60, deadline=None)
@given(
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.sampled_from([-1, 1, 3, 10]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.05]),
    min_p=st.sampled_from([0.0, 0.05, 0.5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_chosen_token_always_inside_every_filter(
    temperature: float, top_k: int, top_p: float, min_p: float, seed: int
) -> None:
    logits = make_logits(3, seed=seed % 1000)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    out = sample(logits, [row(params) for _ in range(3)], seed=seed)
    for i, token in enumerate(out.token_ids):
        if temperature == 0.0:
            assert token == int(logits[i].argmax())
            continue
        scaled = logits[i] / temperature
        order = scaled.argsort(descending=True).tolist()
        rank = order.index(token)
        if top_k != -1:
            assert rank < top_k
        probs = scaled.softmax(-1)
        kept = order[: top_k if top_k != -1 else len(order)]
        renorm = probs[kept] / probs[kept].sum()
        assert float(renorm[:rank].sum()) < top_p + 1e-5  # inside the nucleus
        assert float(probs[token]) >= min_p * float(probs.max()) - 1e-7


# --- penalties ---------------------------------------------------------------------------------------


def test_repetition_penalty_matches_hugging_face() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from pagedllm.sampling.penalties import apply_repetition_penalty, token_counts

    prompt, output = [1, 5, 7, 7], [9, 5, 20]
    penalty = 1.7
    for seed in range(20):
        logits = make_logits(1, seed=seed)
        hf = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits.clone())
        seen = token_counts([prompt + output], VOCAB, logits.device) > 0
        ours = logits.clone()
        apply_repetition_penalty(ours, seen, torch.tensor([penalty]))
        assert torch.equal(ours, hf)
        out = sample(logits, [row(SamplingParams(temperature=0, repetition_penalty=penalty), prompt, output)])
        assert out.token_ids[0] == int(hf.argmax())


def test_repetition_penalty_hand_computed() -> None:
    # Token 0 (seen, positive 2.0 -> 1.0) vs token 1 (unseen 1.5): penalty flips the choice.
    logits = torch.tensor([[2.0, 1.5, -1.0, -3.0]])
    assert sample(logits, [row(SamplingParams(temperature=0), [0], [])]).token_ids == [0]
    out = sample(logits, [row(SamplingParams(temperature=0, repetition_penalty=2.0), [0], [])])
    assert out.token_ids == [1]
    # Negative seen logits get multiplied: token 2 (seen, -1 -> -4) stays below token 3 (-3).
    logits = torch.tensor([[-5.0, -5.0, -1.0, -3.0]])
    out = sample(logits, [row(SamplingParams(temperature=0, repetition_penalty=4.0), [2], [])])
    assert out.token_ids == [3]


def test_presence_and_frequency_penalties_hand_computed() -> None:
    # Output [0, 0, 0, 1]: token 0 has count 3, token 1 count 1, token 2 unseen; prompt is ignored.
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.9]])
    params = SamplingParams(temperature=0, frequency_penalty=0.5)  # 3-1.5=1.5, 2-0.5=1.5 vs 1.0
    assert sample(logits, [row(params, [2], [0, 0, 0, 1])]).token_ids == [0]
    params = SamplingParams(temperature=0, frequency_penalty=0.6)  # 1.2, 1.4, 1.0 -> token 1
    assert sample(logits, [row(params, [2], [0, 0, 0, 1])]).token_ids == [1]
    params = SamplingParams(temperature=0, presence_penalty=1.5)  # 1.5, 0.5, 1.0 -> token 0
    assert sample(logits, [row(params, [2], [0, 0, 0, 1])]).token_ids == [0]
    params = SamplingParams(temperature=0, presence_penalty=2.0)  # 1.0, 0.0, 1.0 (prompt token 2 unpenalised)
    out = sample(logits, [row(params, [2], [0, 0, 0, 1])])
    assert out.token_ids == [0]  # tie 1.0 / 1.0: first index
    params = SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=0.1)  # 0.7, -0.1, 1.0
    assert sample(logits, [row(params, [2], [0, 0, 0, 1])]).token_ids == [2]


def test_penalised_distribution_matches_hand_computation() -> None:
    from pagedllm.sampling.penalties import (
        apply_presence_frequency_penalties,
        apply_repetition_penalty,
        token_counts,
    )

    logits = torch.tensor([[1.0, -2.0, 0.5, 3.0], [0.0, 1.0, 2.0, -1.0]])
    prompts, outputs = [[0, 1], [3]], [[2, 2, 5000], []]  # 5000: out of range, ignored
    out_counts = token_counts(outputs, 4, logits.device)
    assert out_counts.tolist() == [[0, 0, 2, 0], [0, 0, 0, 0]]
    seen = (token_counts(prompts, 4, logits.device) > 0) | (out_counts > 0)
    processed = logits.clone()
    apply_repetition_penalty(processed, seen, torch.tensor([2.0, 1.5]))
    apply_presence_frequency_penalties(processed, out_counts, torch.tensor([0.5, 1.0]), torch.tensor([0.25, 1.0]))
    expected = torch.tensor([[0.5, -4.0, 0.25 - 0.5 - 0.5, 3.0], [0.0, 1.0, 2.0, -1.5]])
    assert torch.allclose(processed, expected)


def test_penalties_do_not_change_reported_logprobs() -> None:
    logits = make_logits(1)
    out = sample(logits, [row(SamplingParams(temperature=0, repetition_penalty=3.0, logprobs=2), [0, 1, 2], [4])])
    raw = torch.log_softmax(logits, -1)[0]
    assert out.logprobs[0] == pytest.approx(float(raw[out.token_ids[0]]), abs=1e-6)


# --- min_tokens ---------------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    logits = torch.zeros(1, 8)
    logits[0, EOS] = 10.0
    logits[0, 5] = 9.0
    logits[0, 6] = 8.0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5])
    assert sample(logits, [row(params, output=[1])]).token_ids == [6]
    assert sample(logits, [row(params, output=[1, 1])]).token_ids == [EOS]  # min_tokens reached
    ignore = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5], ignore_eos=True)
    assert sample(logits, [row(ignore, output=[])]).token_ids == [EOS]  # ignore_eos: EOS is an ordinary token
    sampled = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[5])
    tokens = sample(logits.repeat(300, 1), [row(sampled) for _ in range(300)]).token_ids
    assert EOS not in tokens and 5 not in tokens


def test_min_tokens_reported_logprob_is_raw() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 5.0]])
    out = sample(logits, [row(SamplingParams(temperature=0, min_tokens=1))])
    assert out.token_ids == [0]
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(logits, -1)[0, 0]))


# --- logprobs -----------------------------------------------------------------------------------------


def test_logprobs_k_returns_chosen_plus_top_k() -> None:
    logits = make_logits(3)
    raw = torch.log_softmax(logits, -1)
    rows = [row(SamplingParams(logprobs=3)), row(SamplingParams(logprobs=0)), row(SamplingParams())]
    out = sample(logits, rows, seed=2)
    top0 = out.top_logprobs[0]
    assert top0 is not None
    expected_ids = set(raw[0].topk(3).indices.tolist()) | {out.token_ids[0]}
    assert set(top0) == expected_ids
    for token_id, value in top0.items():
        assert value == pytest.approx(float(raw[0, token_id]), abs=1e-6)
    assert out.top_logprobs[1] == {out.token_ids[1]: pytest.approx(float(raw[1, out.token_ids[1]]), abs=1e-6)}
    assert out.top_logprobs[2] is None
    for i in range(3):
        assert out.logprobs[i] == pytest.approx(float(raw[i, out.token_ids[i]]), abs=1e-6)
        assert math.isfinite(out.logprobs[i])


def test_full_logprobs_on_request() -> None:
    logits = make_logits(2)
    out = sample(logits, [row(SamplingParams(temperature=0)), row(SamplingParams())], return_full_logprobs=True)
    assert out.full_logprobs is not None
    assert torch.allclose(out.full_logprobs, torch.log_softmax(logits, -1))


@settings(max_examples=80, deadline=None)
@given(
    ks=st.lists(st.sampled_from([-1, 1, 5, 40, 100]), min_size=4, max_size=4),
    ps=st.lists(st.sampled_from([1.0, 0.999, 0.9, 0.5, 0.1]), min_size=4, max_size=4),
    scale=st.sampled_from([0.3, 1.0, 4.0]),
    seed=st.integers(0, 10_000),
)
def test_top_k_top_p_candidate_path_equals_full_sort(ks: list[int], ps: list[float], scale: float, seed: int) -> None:
    """The fast path (best NUCLEUS_CANDIDATES tokens, full sort only for wide nuclei) masks exactly
    what sorting the whole vocabulary masks."""
    from pagedllm.sampling import penalties

    vocab = 512
    logits = make_logits(4, vocab=vocab, seed=seed) * scale
    top_k = torch.tensor([vocab if k == -1 else k for k in ks])
    top_p = torch.tensor(ps)
    expected = penalties._top_k_top_p_full_sort(logits, top_k, top_p)
    original = penalties.NUCLEUS_CANDIDATES
    try:
        penalties.NUCLEUS_CANDIDATES = 64
        fast = penalties.apply_top_k_top_p(logits, top_k, top_p)
    finally:
        penalties.NUCLEUS_CANDIDATES = original
    assert torch.equal(torch.isfinite(fast), torch.isfinite(expected))
    assert torch.equal(fast[torch.isfinite(fast)], logits[torch.isfinite(fast)])


def test_greedy_kernel_matches_torch(kernel_level) -> None:
    """The fused CPU greedy choice: torch.argmax's ids (first of ties) and log_softmax's values."""
    from pagedllm.kernels.attention import greedy_pick

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 5001, generator=gen) * 4
    logits[3, [10, 20]] = 100.0  # a tie: the first index wins, as in torch.argmax
    logits[5] = 0.0  # all equal
    logits[7, 4999] = 100.0  # the maximum past the last full 16-wide chunk
    logits[8, [4995, 5000]] = 100.0  # a tie within that tail
    ids, logprobs = greedy_pick(logits)
    assert torch.equal(ids, logits.argmax(dim=-1))
    expected = torch.log_softmax(logits, dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-5)
    assert greedy_pick(logits.double()) is None  # other dtypes take the torch path
    kernel_level.assert_ran("greedy_pick")


def test_greedy_kernel_reads_bfloat16_logits(kernel_level) -> None:
    """bfloat16 logits, read as they are: the ids and logprobs of the same values widened to float32."""
    from pagedllm.kernels.attention import greedy_pick

    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(9, 3001, generator=gen) * 4).bfloat16()
    logits[2, [7, 2999]] = 50.0  # a tie, the second one in the tail past the last 16-wide chunk
    logits[4, 3000] = 60.0  # the maximum in that tail
    ids, logprobs = greedy_pick(logits)
    wide = logits.float()
    assert torch.equal(ids, wide.argmax(dim=-1))
    assert logprobs.dtype == torch.float32
    expected = torch.log_softmax(wide, dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-5)
    kernel_level.assert_ran("greedy_pick")


def test_sampler_takes_bfloat16_logits() -> None:
    """Logits in the model's dtype: plain greedy, random and logprob rows give what float32 logits give."""
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 50, generator=gen) * 3).bfloat16()
    sampler = Sampler(EOS, 50)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2)
    random_row = SamplingParams(temperature=0.8, max_tokens=4)
    rows = [row(greedy), row(with_logprobs), row(random_row)]
    ours = sampler(logits, rows, torch.Generator().manual_seed(0))
    wide = sampler(logits.float(), rows, torch.Generator().manual_seed(0))
    assert ours.token_ids == wide.token_ids
    assert ours.token_ids[:2] == logits.float().argmax(dim=-1).tolist()[:2]
    assert ours.logprobs == pytest.approx(wide.logprobs, abs=1e-5)
    assert ours.top_logprobs == wide.top_logprobs
    plain = sampler(logits, [row(greedy) for _ in range(3)])  # all plain greedy: the fused kernel's path
    assert plain.token_ids == logits.float().argmax(dim=-1).tolist()
    expected = torch.log_softmax(logits.float(), dim=-1).max(dim=-1).values.tolist()
    assert plain.logprobs == pytest.approx(expected, abs=1e-5)
    full = sampler(logits, rows, torch.Generator().manual_seed(0), return_full_logprobs=True).full_logprobs
    assert full.dtype == torch.float32

