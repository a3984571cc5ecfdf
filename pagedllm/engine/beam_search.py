"""Beam search inside the engine, as the paper does it.

The beams of a request are the running sequences of its group. They share every physical block
up to the point where they diverge: each step the surviving candidates fork from their parents
(the block manager's fork shares all blocks; the first write into a shared last block is a
copy-on-write), and a beam without a surviving candidate frees its references. The pattern of
sharing changes every step, which is what makes beam search the paper's best case for paging.

The search itself reproduces Hugging Face transformers' ``generate(num_beams=k, do_sample=False)``
(the vectorised ``GenerationMixin._beam_search``), so that the returned sequences and their order
are the same:

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.core.scheduler import Scheduler
from pagedllm.core.stop_checker import check_stop
from pagedllm.engine.detokenizer import detokenize_incrementally
from pagedllm.sampling.logprob_rank import ranked_entry, vocab_ranks
from pagedllm.sampling.penalties import apply_presence_frequency_penalties, apply_repetition_penalty, token_counts
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus

# HF's placeholder score for "no hypothesis in this slot yet".
_NO_SCORE = -1.0e9


@dataclass(slots=True)
class _Candidate:
    rank: int
    parent: int  # index into this step's beams
    token_id: int
    score: float  # running score: summed (processed) log-probabilities, a float32 value


@dataclass
class BeamSearchState:
    """Per-request search state, kept on the SequenceGroup (``group.beam_state``)."""

    beam_width: int
    max_new_tokens: int
    # seq_id -> summed log-probability of the running beam (float32 values, as HF keeps them).
    running_scores: dict[int, float] = field(default_factory=dict)
    # Finished hypotheses, best first: (length-penalised score, sequence). At most beam_width.
    finished: list[tuple[float, Sequence]] = field(default_factory=list)
    # HF's is_early_stop_heuristic_unsatisfied: once False, the search ends.
    improvement_possible: bool = True


class BeamSearcher:
    """Advances the beam-search groups of a step: ranks candidates, forks, frees, finishes."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Any,
        eos_token_id: int | None,
        max_seq_len: int,
        new_seq_id: Callable[[], int],
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.max_seq_len = max_seq_len
        self.new_seq_id = new_seq_id

    def eos_ids(self, params: SamplingParams) -> list[int]:
        """The tokens that end a hypothesis: EOS (unless ignored) and the stop tokens (HF's eos list)."""
        ids: list[int] = []
        if self.eos_token_id is not None and not params.ignore_eos:
            ids.append(self.eos_token_id)
        ids.extend(t for t in params.stop_token_ids or () if t not in ids)
        return ids

    def _state(self, group: SequenceGroup) -> BeamSearchState:
        state = group.beam_state
        if state is None:
            params = group.sampling_params
            max_new = self.max_seq_len - len(group.prompt_token_ids)
            if params.max_tokens is not None:
                max_new = min(max_new, params.max_tokens)
            state = group.beam_state = BeamSearchState(beam_width=params.best_of, max_new_tokens=max(1, max_new))
        return state

    def step(self, group: SequenceGroup, beams: list[Sequence], raw_logprobs: torch.Tensor) -> int:
        """Advance one group by one token.

        ``beams``: the group's running sequences in the order of ``raw_logprobs``' rows (``[len(beams),
        V]``, the model's raw log-probabilities for each beam's next token). Afterwards
        ``group.seqs`` holds the new beams (best first) followed by the kept hypotheses (best first);
        when the search is over it holds only the hypotheses, all finished. Returns the number of
        tokens generated (one per beam stepped).
        """
        params = group.sampling_params
        state = self._state(group)
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
        done = is_last or not next_beams or self._no_improvement(state, params, next_beams, kept, gen_len)
        if done and not is_last and not kept:
            # HF's stopping rule can end the search before any hypothesis exists (a strongly negative
            # length_penalty makes every running score look hopeless): the candidates then finish
            # as at the last length, as HF's BeamSearchScorer.finalize adds the open beams.
            next_beams, kept = self._select(state, candidates, penalised, eos_ids, True)

        # Children first, while every parent still has its pre-step state: a fork copies it.
        kept_seqs: list[tuple[float, Sequence]] = []
        new_hypotheses: list[tuple[Sequence, _Candidate]] = []
        for score, entry in kept:
            if isinstance(entry, _Candidate):
                # A finished hypothesis needs no blocks: its K/V are never read again.
                hypothesis = beams[entry.parent].fork(self.new_seq_id())
                new_hypotheses.append((hypothesis, entry))
                kept_seqs.append((score, hypothesis))
            else:
                kept_seqs.append((score, entry))
        survivors: list[tuple[Sequence, _Candidate]] = []
        reused: set[int] = set()
        if not done:
            for cand in next_beams:
                parent = beams[cand.parent]
                if cand.parent not in reused:
                    reused.add(cand.parent)  # the first survivor continues the parent itself
                    survivors.append((parent, cand))
                else:
                    child = parent.fork(self.new_seq_id())
                    self.scheduler.fork_seq(parent, child)  # shares all blocks; CoW on the next write
                    # The group owns it at once: if the rest of this step fails, failing the group frees it.
                    group.seqs.append(child)
                    survivors.append((child, cand))
        for index, parent in enumerate(beams):
            if index not in reused:
                # A dead beam only drops its references: blocks shared with survivors stay.
                parent.status = SequenceStatus.FINISHED_ABORTED
                self.scheduler.free_seq(parent)

        chosen = [(seq, cand, False) for seq, cand in survivors] + [(seq, cand, True) for seq, cand in new_hypotheses]
        token_logprobs = self._token_logprobs(raw_logprobs, [(cand.parent, cand.token_id) for _, cand, _ in chosen])
        top = self._top_logprobs(raw_logprobs, params)
        ranks: list[int] = []
        if top is not None and chosen:
            device = raw_logprobs.device
            parents = torch.tensor([cand.parent for _, cand, _ in chosen], device=device)
            ranks = vocab_ranks(raw_logprobs.index_select(0, parents),
                                torch.tensor([cand.token_id for _, cand, _ in chosen], device=device))
        for index, ((seq, cand, is_hypothesis), logprob) in enumerate(zip(chosen, token_logprobs)):
            entry = None
            if top is not None:
                top_ids, top_values = zip(*top[cand.parent]) if top[cand.parent] else ((), ())
                entry = ranked_entry(cand.token_id, logprob, ranks[index], list(top_ids), list(top_values))
            seq.append_token(cand.token_id, logprob, entry)
            # The search ranks by its own (processed, float32) sum; report that one.
            seq.cumulative_logprob = cand.score
            new_text = detokenize_incrementally(self.tokenizer, seq, params)
            if is_hypothesis:
                # Sets the status and strips a stop token's text, as for any other sequence.
                check_stop(seq, params, len(new_text), self.eos_token_id, self.max_seq_len)
                if not seq.is_finished():
                    seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED  # a hypothesis is always finished

        state.finished = kept_seqs
        state.running_scores = {seq.seq_id: cand.score for seq, cand in survivors}
        group.seqs = [seq for seq, _ in survivors] + [seq for _, seq in kept_seqs]
        return len(beams)

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
    def _no_improvement(
        state: BeamSearchState,
        params: SamplingParams,
        next_beams: list[_Candidate],
        kept: list[tuple[float, Any]],
        gen_len: int,
    ) -> bool:
        """HF's stopping rule for the whole search, evaluated after this step."""
        full = len(kept) == state.beam_width
        if params.early_stopping is True and full:
            return True
        if state.improvement_possible:
            if params.early_stopping == "never" and params.length_penalty > 0.0:
                best_length = state.max_new_tokens  # a longer beam may still score better
            else:
                best_length = gen_len
            best_running = torch.tensor([next_beams[0].score], dtype=torch.float32)
            best_possible = (best_running / (best_length**params.length_penalty)).item()
            worst_finished = min(score for score, _ in kept) if full else _NO_SCORE
            state.improvement_possible = best_possible > worst_finished
        return not state.improvement_possible

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


def ranked_outputs(group: SequenceGroup) -> list[Sequence]:
    """The sequences a beam-search request returns: the best n hypotheses once finished,
    the best n running beams while it runs (for streaming)."""
    return group.get_seqs()[: group.sampling_params.n]
