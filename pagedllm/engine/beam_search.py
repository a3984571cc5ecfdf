"""Beam search inside the engine, as the paper does it.

The beams of a request are the running sequences of its group. They share every physical block
up to the point where they diverge: each step the surviving candidates fork from their parents
(the block manager's fork shares all blocks; the first write into a shared last block is a
copy-on-write), and a beam without a surviving candidate frees its references. The pattern of
sharing changes every step, which is what makes beam search the paper's best case for paging.

This module only chooses: ``BeamSearcher.select`` ranks one step's candidates and returns the
decision as data (core/beam_step.py's ``BeamStep``); ``Scheduler.update`` forks, frees and appends.
The search reproduces Hugging Face transformers' ``generate(num_beams=k, do_sample=False)`` (the
vectorised ``GenerationMixin._beam_search``), so that the returned sequences and their order are
the same:

- scores: ``log_softmax`` of the logits, then the logits processors (min_tokens masks the EOS ids,
  repetition penalty on the log-probabilities as HF applies it), plus the beam's running score, in
  float32 like HF;
- candidates: the top ``max(2, 1 + number of EOS ids) * k`` over all beams (the first step has a
  single beam: HF gives its other k - 1 copies of the prompt a score of -1e9);
- an EOS candidate among the first ``k`` ranks becomes a finished hypothesis scored
  ``sum_logprobs / generated_len ** length_penalty`` (generated_len counts the EOS); the first ``k``
  candidates that are not EOS are the next beams;
- at the last allowed length every candidate among the first ``k`` ranks becomes a hypothesis;
- at most ``k`` hypotheses are kept, best first, and the search stops when HF's loop would:
  ``early_stopping=True`` as soon as ``k`` hypotheses exist, ``False`` when the best running beam
  scored at the current length cannot beat the worst of ``k`` hypotheses, ``"never"`` the same but
  at the maximum length when ``length_penalty > 0``.

The returned outputs are the best ``n`` hypotheses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.core.beam_step import BeamChoice, BeamSearchState, BeamStep
from pagedllm.sampling.logprob_rank import ranked_entry, vocab_ranks
from pagedllm.sampling.penalties import apply_presence_frequency_penalties, apply_repetition_penalty, token_counts
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup

# HF's placeholder score for "no hypothesis in this slot yet".
_NO_SCORE = -1.0e9


@dataclass(slots=True)
class _Candidate:
    rank: int
    parent: int  # index into this step's beams
    token_id: int
    score: float  # running score: summed (processed) log-probabilities, a float32 value


class BeamSearcher:
    """Chooses the next beams and the finished hypotheses of a beam-search request's step. It reads
    the group and its search state (``group.beam_state``, set when the request was queued) and
    changes neither."""

    def __init__(self, eos_token_id: int | None) -> None:
        self.eos_token_id = eos_token_id

    def eos_ids(self, params: SamplingParams) -> list[int]:
        """The tokens that end a hypothesis: EOS (unless ignored) and the stop tokens (HF's eos list)."""
        ids: list[int] = []
        if self.eos_token_id is not None and not params.ignore_eos:
            ids.append(self.eos_token_id)
        ids.extend(t for t in params.stop_token_ids or () if t not in ids)
        return ids

    def select(self, group: SequenceGroup, beams: list[Sequence], raw_logprobs: torch.Tensor) -> BeamStep:
        """Rank one step's candidates of ``group``.

        ``beams``: the group's running sequences in the order of ``raw_logprobs``' rows (``[len(beams),
        V]``, the model's raw log-probabilities for each beam's next token). The decision's choices
        name their parent by its index in ``beams``.
        """
        params = group.sampling_params
        state: BeamSearchState = group.beam_state
        k = state.beam_width
        eos_ids = self.eos_ids(params)
        scores = self._processed_scores(params, beams, raw_logprobs, eos_ids)
        vocab_size = scores.shape[1]
        prev = torch.tensor([state.running_scores.get(seq.seq_id, 0.0) for seq in beams], dtype=torch.float32)
        total = (scores + prev.to(scores.device).unsqueeze(1)).reshape(-1)
        num_candidates = min(max(2, 1 + len(eos_ids)) * k, total.numel())
        values, indices = torch.topk(total, num_candidates)
        finite = torch.isfinite(values)
        if not bool(finite.all()):  # forbidden tokens (a structured-output grammar) are never candidates
            values, indices = values[finite], indices[finite]
        gen_len = beams[0].get_output_len() + 1  # all beams have the same length
        length_norm = gen_len**params.length_penalty
        # Penalised in float32, as HF divides its float32 scores (only the first k ranks may finish).
        penalised = (values[:k] / length_norm).tolist()
        candidates = [
            _Candidate(rank, index // vocab_size, index % vocab_size, score)
            for rank, (index, score) in enumerate(zip(indices.tolist(), values.tolist()))
        ]

        is_last = gen_len >= state.max_new_tokens
        next_beams, kept = self._select(state, candidates, penalised, eos_ids, is_last)
        improvement_possible = state.improvement_possible
        done = is_last or not next_beams
        if not done:
            improvement_possible = self._improvement_possible(state, params, next_beams, kept, gen_len)
            done = not improvement_possible
        if done and not is_last and not kept:
            # HF's stopping rule can end the search before any hypothesis exists (a strongly negative
            # length_penalty makes every running score look hopeless): the candidates then finish
            # as at the last length, as HF's BeamSearchScorer.finalize adds the open beams.
            next_beams, kept = self._select(state, candidates, penalised, eos_ids, True)
        survivors = [] if done else next_beams
        new_hypotheses = [entry for _, entry in kept if isinstance(entry, _Candidate)]
        choices = self._choices(raw_logprobs, params, survivors + new_hypotheses)
        hypothesis_choices = iter(choices[len(survivors):])  # in the order of ``kept``
        return BeamStep(
            next_beams=choices[: len(survivors)],
            hypotheses=[(score, next(hypothesis_choices) if isinstance(entry, _Candidate) else entry)
                        for score, entry in kept],
            improvement_possible=improvement_possible,
        )

    def _choices(
        self, raw_logprobs: torch.Tensor, params: SamplingParams, chosen: list[_Candidate]
    ) -> list[BeamChoice]:
        """The chosen candidates with their raw logprobs (and top entries, when the request asks)."""
        token_logprobs = self._token_logprobs(raw_logprobs, [(cand.parent, cand.token_id) for cand in chosen])
        top = self._top_logprobs(raw_logprobs, params)
        ranks: list[int] = []
        if top is not None and chosen:
            device = raw_logprobs.device
            parents = torch.tensor([cand.parent for cand in chosen], device=device)
            ranks = vocab_ranks(raw_logprobs.index_select(0, parents),
                                torch.tensor([cand.token_id for cand in chosen], device=device))
        choices = []
        for index, (cand, logprob) in enumerate(zip(chosen, token_logprobs)):
            entry = None
            if top is not None:
                top_ids, top_values = zip(*top[cand.parent]) if top[cand.parent] else ((), ())
                entry = ranked_entry(cand.token_id, logprob, ranks[index], list(top_ids), list(top_values))
            choices.append(BeamChoice(cand.parent, cand.token_id, logprob, entry, cand.score))
        return choices

    @staticmethod
    def _select(
        state: BeamSearchState, candidates: list[_Candidate], penalised: list[float], eos_ids: list[int], is_last: bool
    ) -> tuple[list[_Candidate], list[tuple[float, Any]]]:
        """(the next beams, the kept hypotheses) after this step's ranking."""
        k = state.beam_width
        eos_set = set(eos_ids)
        hits = [is_last or cand.token_id in eos_set for cand in candidates]
        next_beams = [] if is_last else [cand for cand, hit in zip(candidates, hits) if not hit][:k]
        # Merge the new hypotheses into the kept ones; a stable sort keeps older ones first on ties.
        merged: list[tuple[float, Sequence | _Candidate]] = list(state.finished)
        merged += [(penalised[r], candidates[r]) for r in range(min(k, len(candidates))) if hits[r]]
        merged.sort(key=lambda entry: -entry[0])
        return next_beams, merged[:k]

    @staticmethod
    def _improvement_possible(
        state: BeamSearchState,
        params: SamplingParams,
        next_beams: list[_Candidate],
        kept: list[tuple[float, Any]],
        gen_len: int,
    ) -> bool:
        """HF's stopping rule for the whole search, evaluated after this step: False ends the search."""
        full = len(kept) == state.beam_width
        if params.early_stopping is True and full:
            return False
        if not state.improvement_possible:
            return False
        if params.early_stopping == "never" and params.length_penalty > 0.0:
            best_length = state.max_new_tokens  # a longer beam may still score better
        else:
            best_length = gen_len
        best_running = torch.tensor([next_beams[0].score], dtype=torch.float32)
        best_possible = (best_running / (best_length**params.length_penalty)).item()
        worst_finished = min(score for score, _ in kept) if full else _NO_SCORE
        return best_possible > worst_finished

    @staticmethod
    def _processed_scores(
        params: SamplingParams, beams: list[Sequence], raw_logprobs: torch.Tensor, eos_ids: list[int]
    ) -> torch.Tensor:
        """HF's logits processors, applied to the log-probabilities as HF's beam search does."""
        needs_min = beams[0].get_output_len() < params.min_tokens and eos_ids
        needs_repetition = params.repetition_penalty != 1.0
        needs_presence = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        if not (needs_min or needs_repetition or needs_presence):
            return raw_logprobs
        scores = raw_logprobs.clone()
        vocab_size = scores.shape[1]
        if needs_min:
            scores[:, [t for t in eos_ids if 0 <= t < vocab_size]] = -math.inf
        if needs_repetition or needs_presence:
            output_counts = token_counts([seq.output_token_ids for seq in beams], vocab_size, scores.device)
        if needs_repetition:
            prompt_counts = token_counts([seq.prompt_token_ids for seq in beams], vocab_size, scores.device)
            penalties = torch.full((len(beams),), params.repetition_penalty, dtype=scores.dtype, device=scores.device)
            apply_repetition_penalty(scores, (prompt_counts > 0) | (output_counts > 0), penalties)
        if needs_presence:
            ones = torch.ones(len(beams), dtype=scores.dtype, device=scores.device)
            apply_presence_frequency_penalties(
                scores, output_counts, ones * params.presence_penalty, ones * params.frequency_penalty
            )
        return scores

    @staticmethod
    def _token_logprobs(raw_logprobs: torch.Tensor, pairs: list[tuple[int, int]]) -> list[float]:
        if not pairs:
            return []
        rows = torch.tensor([p for p, _ in pairs], device=raw_logprobs.device)
        cols = torch.tensor([t for _, t in pairs], device=raw_logprobs.device)
        return raw_logprobs[rows, cols].tolist()

    @staticmethod
    def _top_logprobs(raw_logprobs: torch.Tensor, params: SamplingParams) -> list[list[tuple[int, float]]] | None:
        if params.logprobs is None:
            return None
        if params.logprobs == 0:
            return [[] for _ in range(raw_logprobs.shape[0])]
        values, ids = raw_logprobs.topk(min(params.logprobs, raw_logprobs.shape[1]), dim=-1)
        return [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]

