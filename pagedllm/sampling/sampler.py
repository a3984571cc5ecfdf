"""The sampler: model logits of a batch in, one token per row out.

Order of operations (per row, vectorised over the batch):

0. structured outputs: tokens the row's grammar forbids get -inf (so every logprob reported,
   and every beam candidate, is inside the grammar, as with vLLM's bitmask before the sampler);
   plain greedy rows get the same result without masking, from a pass over the allowed tokens;
1. raw logprobs = log_softmax(raw logits); reported logprobs and cumulative logprobs use these
   (vLLM V1's default "raw" logprobs mode);
2. min_tokens: while fewer than ``min_tokens`` tokens were generated, EOS (unless ``ignore_eos``)
   and ``stop_token_ids`` are masked;
3. repetition penalty (Hugging Face semantics, over prompt + output tokens);
4. presence / frequency penalties (OpenAI semantics, over output tokens);
4b. logit_bias (OpenAI's: added to the logits of the given tokens);
5. greedy rows (temperature 0) take the argmax here;
6. temperature, top-k, top-p, min-p, then a draw.

The draw is by inverse CDF: one U[0, 1) number per row, the first token whose cumulative
probability exceeds it. Drawing that number with the row's own ``torch.Generator`` makes a
seeded request's tokens independent of whatever else is batched with it (every other step is
row-wise); rows without a generator share the engine's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.kernels.attention import greedy_pick
from pagedllm.sampling.logprob_rank import ranked_entry, vocab_ranks
from pagedllm.sampling.penalties import (
    apply_min_p,
    apply_min_tokens,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    apply_top_k_top_p,
    token_counts,
)
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured.bitmask import apply_token_bitmask, greedy_pick_masked

logger = logging.getLogger(__name__)

_EPS = 1e-5


@dataclass
class SamplingRow:
    """One sequence to sample a token for."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Per-request generator seeded with params.seed; None -> the engine's shared generator.
    generator: torch.Generator | None = None
    # Structured outputs: [ceil(V / 32)] int32 bitmask of the tokens the grammar allows (None: all).
    # A speculating sequence's row carries [drafts + 1, ceil(V / 32)], one per sampler row, until
    # SeqStepInput.sampling_rows gives each row its own; the sampler sees only 1-D masks.
    token_bitmask: torch.Tensor | None = None
    # Speculative decoding: report the row's generator state before its draw, so that the draws of
    # rows whose drafts were rejected can be taken back (SamplerOutput.generator_states).
    keep_generator_state: bool = False


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # The chosen token's raw logprob (log_softmax of the model's logits).
    logprobs: list[float]
    # {token_id: logprob} with the chosen token and the top ``params.logprobs``; None when not asked.
    top_logprobs: list[dict[int, float] | None]
    # [N, V] raw logprobs, only when asked for (beam search ranks candidates with them).
    full_logprobs: torch.Tensor | None = None
    # Rows whose sampling raised (row index -> the exception): their token is a placeholder and the
    # engine finishes their request with an error; every other row was sampled normally.
    failed_rows: dict[int, BaseException] = field(default_factory=dict)
    # prompt_logprobs by seq id (see pagedllm/sampling/prompt_logprobs.py), for the sequences asking.
    prompt_logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)
    # Row -> its own generator's state before the row drew, for rows with keep_generator_state.
    generator_states: dict[int, torch.Tensor] = field(default_factory=dict)
    # Speculative decoding with a draft model: the drafts it proposed this step, by seq id.
    model_draft_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Pooling requests: this step's chunk of each one's pooled hidden states, by seq id (worker/pooler.py).
    pooled: dict[int, Any] = field(default_factory=dict)


class Sampler:
    def __init__(self, eos_token_id: int | None, vocab_size: int) -> None:
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        generator: torch.Generator | None = None,
        *,
        return_full_logprobs: bool = False,
    ) -> SamplerOutput:
        """Sample one token per row of ``logits`` ``[N, V]``.

        ``generator`` serves the rows that have none of their own (None -> torch's default).
        ``return_full_logprobs`` also returns the ``[N, V]`` raw logprobs; so does any beam-search
        row (the engine ranks beam candidates with them). A beam-search row draws no random number:
        its token is chosen by the engine, and it must not shift other rows' draws.
        """
        if logits.shape[0] != len(rows):
            raise ValueError(f"logits has {logits.shape[0]} rows but {len(rows)} sampling rows were given.")
        if not rows:
            empty = logits.new_empty((0, self.vocab_size), dtype=torch.float32) if return_full_logprobs else None
            return SamplerOutput([], [], [], empty)
        return_full_logprobs = return_full_logprobs or any(row.params.use_beam_search for row in rows)
        states = _generator_states(rows)
        try:
            output = self._sample_batch(logits, rows, generator, return_full_logprobs)
        except Exception:  # noqa: BLE001 - find the rows at fault: every other row must still get its token
            logger.warning("sampling a batch of %d row(s) failed; sampling them one by one", len(rows))
            output = self._sample_rows_apart(logits, rows, generator, return_full_logprobs)
        output.generator_states = states
        return output

    def _sample_rows_apart(
        self, logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None, full: bool
    ) -> SamplerOutput:
        """Sample each row on its own; a row that raises gets a placeholder token and an entry in failed_rows.

        Only taken after a batch failed (a request whose settings slipped past validation): one
        request's bad settings must not take down every request batched with it.
        """
        token_ids: list[int] = []
        logprobs: list[float] = []
        top_logprobs: list[dict[int, float] | None] = []
        full_rows: list[torch.Tensor] = []
        failed: dict[int, BaseException] = {}
        for index, row in enumerate(rows):
            try:
                one = self._sample_batch(logits[index : index + 1], [row], generator, full)
            except Exception as exc:  # noqa: BLE001 - reported to the engine, which fails the request
                failed[index] = exc
                token_ids.append(0)
                logprobs.append(float("-inf"))
                top_logprobs.append(None)
                if full:
                    full_rows.append(torch.full((1, self.vocab_size), float("-inf"), device=logits.device))
                continue
            token_ids.extend(one.token_ids)
            logprobs.extend(one.logprobs)
            top_logprobs.extend(one.top_logprobs)
            if full:
                assert one.full_logprobs is not None
                full_rows.append(one.full_logprobs)
        return SamplerOutput(token_ids, logprobs, top_logprobs, torch.cat(full_rows) if full else None, failed)

    def _sample_batch(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        generator: torch.Generator | None,
        return_full_logprobs: bool,
    ) -> SamplerOutput:
        # Some models pad the vocabulary; padded columns are never sampled. Logits come in the
        # model's dtype; everything but the fused greedy kernel works on them in float32.
        logits = logits[:, : self.vocab_size]
        bitmasks = [row.token_bitmask for row in rows]
        constrained = any(mask is not None for mask in bitmasks)

        banned = self._min_tokens_banned(rows)
        needs_repetition = any(row.params.repetition_penalty != 1.0 for row in rows)
        needs_presence_frequency = any(
            row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0 for row in rows
        )
        needs_bias = any(row.params.logit_bias for row in rows)
        wants_top = any(row.params.logprobs is not None for row in rows)
        all_greedy = all(_is_deterministic(row.params) for row in rows)
        plain_greedy = (all_greedy and banned is None and not needs_repetition and not needs_presence_frequency
                        and not needs_bias)
        # Plain greedy needs only each row's argmax and its logprob: one fused pass where our CPU
        # kernel is built, not a [N, V] log_softmax; under grammars, a pass over the allowed tokens only.
        fused_greedy = plain_greedy and not return_full_logprobs and not wants_top
        picked = greedy_pick(logits) if fused_greedy and not constrained else None  # reads bfloat16 as is
        if picked is None:  # every other path reads float32 logits (a copy of [N, V] when they are not)
            logits = logits.float()
            if fused_greedy and constrained:
                picked = greedy_pick_masked(logits, bitmasks)
        raw_logprobs = None
        if picked is not None:
            token_ids, chosen_logprobs = picked
        else:
            if constrained:
                # In place: masking twice (a retry row by row) gives the same logits.
                apply_token_bitmask(logits, bitmasks)
            raw_logprobs = torch.log_softmax(logits, dim=-1)
            if plain_greedy:
                token_ids = logits.argmax(dim=-1)  # argmax of logits == argmax of logprobs
            else:
                processed = logits.clone()
                if banned is not None:
                    apply_min_tokens(processed, banned)
                if needs_repetition or needs_presence_frequency:
                    self._apply_penalties(processed, rows, needs_repetition, needs_presence_frequency)
                if needs_bias:
                    _apply_logit_bias(processed, rows)
                token_ids = self._choose(processed, rows, generator)
            chosen_logprobs = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        token_list: list[int] = token_ids.tolist()
        logprob_list: list[float] = chosen_logprobs.tolist()
        top_logprobs = self._top_logprobs(raw_logprobs, rows, token_list, logprob_list)
        return SamplerOutput(
            token_ids=token_list,
            logprobs=logprob_list,
            top_logprobs=top_logprobs,
            full_logprobs=raw_logprobs if return_full_logprobs else None,
        )

    def _min_tokens_banned(self, rows: list[SamplingRow]) -> list[list[int]] | None:
        """Per row, the ids that must not be sampled yet (None when no row has any)."""
        banned: list[list[int]] = []
        any_banned = False
        for row in rows:
            params = row.params
            ids: list[int] = []
            if len(row.output_token_ids) < params.min_tokens:
                ids.extend(params.stop_token_ids or ())
                if self.eos_token_id is not None and not params.ignore_eos:
                    ids.append(self.eos_token_id)
            any_banned = any_banned or bool(ids)
            banned.append(ids)
        return banned if any_banned else None

    def _apply_penalties(
        self, logits: torch.Tensor, rows: list[SamplingRow], repetition: bool, presence_frequency: bool
    ) -> None:
        device = logits.device
        output_counts = token_counts([row.output_token_ids for row in rows], self.vocab_size, device)
        if repetition:
            prompt_counts = token_counts([row.prompt_token_ids for row in rows], self.vocab_size, device)
            seen = (prompt_counts > 0) | (output_counts > 0)
            penalties = torch.tensor([row.params.repetition_penalty for row in rows], dtype=logits.dtype)
            apply_repetition_penalty(logits, seen, penalties.to(device))
        if presence_frequency:
            presence = torch.tensor([row.params.presence_penalty for row in rows], dtype=logits.dtype)
            frequency = torch.tensor([row.params.frequency_penalty for row in rows], dtype=logits.dtype)
            apply_presence_frequency_penalties(logits, output_counts, presence.to(device), frequency.to(device))

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None) -> torch.Tensor:
        device = logits.device
        token_ids = torch.empty(len(rows), dtype=torch.int64, device=device)
        greedy_index = [i for i, row in enumerate(rows) if _is_deterministic(row.params)]
        sample_index = [i for i, row in enumerate(rows) if not _is_deterministic(row.params)]
        if greedy_index:
            index = torch.as_tensor(greedy_index, device=device)
            token_ids[index] = logits[index].argmax(dim=-1)
        if len(sample_index) == len(rows):
            return self._sample(logits, rows, generator)  # no row copies when nothing is greedy
        if sample_index:
            index = torch.as_tensor(sample_index, device=device)
            sample_rows = [rows[i] for i in sample_index]
            token_ids[index] = self._sample(logits[index], sample_rows, generator)
        return token_ids

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None) -> torch.Tensor:
        device = logits.device
        params = [row.params for row in rows]
        temperatures = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
        logits = logits / temperatures.unsqueeze(1)
        vocab_size = logits.shape[1]
        top_k = top_p = None
        if any(p.top_k != -1 for p in params):
            top_k = torch.tensor([vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params])
            top_k = top_k.to(device)
        if any(p.top_p < 1.0 - _EPS for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=device)
        if top_k is not None or top_p is not None:
            logits = apply_top_k_top_p(logits, top_k, top_p)
        if any(p.min_p > _EPS for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=device)
            logits = apply_min_p(logits, min_p)
        probs = logits.softmax(dim=-1)
        return _inverse_cdf_sample(probs, self._uniforms(rows, device, generator))

    @staticmethod
    def _uniforms(rows: list[SamplingRow], device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
        """``[N]`` U[0, 1) draws; a row with its own generator draws from it alone."""
        uniforms = torch.empty(len(rows), dtype=torch.float32)
        shared_index = [i for i, row in enumerate(rows) if row.generator is None]
        for i, row in enumerate(rows):
            if row.generator is not None:
                uniforms[i] = _draw_uniform(1, row.generator)[0]
        if shared_index:
            uniforms[torch.as_tensor(shared_index)] = _draw_uniform(len(shared_index), generator)
        return uniforms.to(device)

    def _top_logprobs(
        self,
        raw_logprobs: torch.Tensor | None,  # None only when no row asks for logprobs
        rows: list[SamplingRow],
        token_ids: list[int],
        chosen_logprobs: list[float],
    ) -> list[dict[int, float] | None]:
        wanted = [row.params.logprobs for row in rows]
        max_k = max((k for k in wanted if k is not None), default=None)
        if max_k is None:
            return [None] * len(rows)
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        if max_k > 0:
            values, ids = raw_logprobs.topk(min(max_k, raw_logprobs.shape[1]), dim=-1)
            top_values, top_ids = values.tolist(), ids.tolist()
        ranks = vocab_ranks(raw_logprobs, torch.tensor(token_ids, device=raw_logprobs.device))
        result: list[dict[int, float] | None] = []
        for i, k in enumerate(wanted):
            if k is None:
                result.append(None)
                continue
            ids_row, values_row = (top_ids[i][:k], top_values[i][:k]) if k > 0 else ([], [])
            result.append(ranked_entry(token_ids[i], chosen_logprobs[i], ranks[i], ids_row, values_row))
        return result


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    row_index: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in (row.params.logit_bias or {}).items():
            row_index.append(i)
            token_ids.append(token_id)
            biases.append(bias)
    device = logits.device
    logits.index_put_(
        (torch.tensor(row_index, device=device), torch.tensor(token_ids, device=device)),
        torch.tensor(biases, dtype=logits.dtype, device=device),
        accumulate=True,
    )


def _generator_states(rows: list[SamplingRow]) -> dict[int, torch.Tensor]:
    """The state of each own generator of rows asking for it, before the batch draws, keyed by the
    first row that uses it (a speculating sequence's rows are adjacent and share one generator)."""
    states: dict[int, torch.Tensor] = {}
    for i, row in enumerate(rows):
        gen = row.generator
        if row.keep_generator_state and gen is not None and not (i and rows[i - 1].generator is gen):
            states[i] = gen.get_state()
    return states


def rewind_generator(generator: torch.Generator, state: torch.Tensor, num_rows: int, params: SamplingParams) -> None:
    """Put ``generator`` where it would be had only ``num_rows`` rows of ``params`` drawn after ``state``:
    draws of rows past a rejected draft are taken back, so a seeded request's tokens are the same
    with or without speculation (each draws one number per token, in order)."""
    generator.set_state(state)
    if not _is_deterministic(params):
        for _ in range(num_rows):
            _draw_uniform(1, generator)


def _is_deterministic(params: SamplingParams) -> bool:
    # Beam search is deterministic (HF's do_sample=False) whatever its temperature says.
    return params.is_greedy or params.use_beam_search


def _draw_uniform(count: int, generator: torch.Generator | None) -> torch.Tensor:
    # A generator lives on one device: draw there (a handful of numbers) and bring them to the CPU.
    device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(count, generator=generator, device=device).cpu()


def _inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token ``i`` with probability ``probs[i]``: the first index whose cumulative mass exceeds ``u``.

    One random number per row, not per vocabulary entry: on a CPU the random draws of the
    exponential-race trick (``argmax(probs / Exp(1))``) cost more than the whole rest of sampling.
    """
    cdf = probs.cumsum(dim=-1)
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    token_ids = torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
    # Rounding can push the target past the last nonzero entry; never return a masked token.
    masked = probs.gather(1, token_ids.unsqueeze(1)).squeeze(1) == 0
    return torch.where(masked, probs.argmax(dim=-1), token_ids)
