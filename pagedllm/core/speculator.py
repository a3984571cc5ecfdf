"""When a decoding sequence speculates, how many tokens, and what came of it.

The scheduler asks for drafts before it books a decode's slots and token budget, and reports how
many were accepted after verification. Drafts are never proposed for beam search (its beams are
ranked per token across the group). Structured outputs speculate as vLLM's do: a draft is cut at
the first token its grammar refuses (verifying it would only waste a row: the masked row can never
sample it), and the engine masks verification row j with the grammar's state after drafts[:j].
Both walk the sequence's matcher through the drafts and roll it back, so the matcher is the
sequence's own state again when verification appends the real tokens. The counters are vLLM's
spec-decode metrics: drafts, draft tokens, accepted tokens, and accepted tokens per draft position.
"""

from __future__ import annotations

from typing import Any, Protocol

from pagedllm.config import SpeculativeConfig
from pagedllm.sequence import Sequence, SequenceGroup


class Proposer(Protocol):
    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]: ...

    def request_finished(self, request_id: str, token_ids: list[int], prompt_len: int) -> None: ...


# A draft model's drafts are made by the worker within the step that verifies them: the scheduler
# books their slots and token budget with this stand-in, and the worker's drafts replace it before
# verification (worker/draft_model.py).
DRAFT_FROM_MODEL = -1


class _WorkerProposes:
    """The draft_model method's proposer on this side: as many stand-ins as allowed."""

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        return [DRAFT_FROM_MODEL] * max_tokens

    def request_finished(self, request_id: str, token_ids: list[int], prompt_len: int) -> None:
        pass


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "draft_model":
        return _WorkerProposes()
    if config.method == "ngram":
        from pagedllm.core.ngram_proposer import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from pagedllm.core.suffix_proposer import SuffixProposer

    return SuffixProposer(
        max_tree_depth=config.suffix_decoding_max_tree_depth,
        max_cached_requests=config.suffix_decoding_max_cached_requests,
        max_spec_factor=config.suffix_decoding_max_spec_factor,
        min_token_prob=config.suffix_decoding_min_token_prob,
    )


def grammar_accepted_prefix(matcher: Any, drafts: list[int]) -> int:
    """How many of ``drafts``, from the first, the grammar matcher (xgrammar's) accepts in order;
    the matcher is left as it was.

    A draft that ends the grammar (its stop token) is not counted: the row after it would have to be
    masked from a terminated matcher, which has no next-token mask, and that draft would finish
    the sequence anyway (its row's own sample gives the same stop).
    """
    if matcher.is_terminated():  # nothing follows (and accepting would only log a warning)
        return 0
    accepted = 0
    terminated = False
    try:
        for token in drafts:
            if not matcher.accept_token(token):
                break
            accepted += 1
            if matcher.is_terminated():
                terminated = True
                break
    finally:
        if accepted:
            matcher.rollback(accepted)
    return accepted - terminated


def _key(group: SequenceGroup, seq: Sequence) -> str:
    # Parallel samples of one request diverge: each keeps its own proposer state.
    return f"{group.request_id}/{seq.seq_id}"


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = make_proposer(config)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens
        self.num_requests_switched_off = 0

    def enabled_for_batch(self, num_running_seqs: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or num_running_seqs < limit

    def propose(self, group: SequenceGroup, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens for ``seq``'s next step, at most ``budget``, none past max_tokens or the context."""
        params = group.sampling_params
        if seq.spec_disabled or params.use_beam_search:
            return []
        if self.config.method == "draft_model" and seq.grammar is not None:
            return []  # the worker's drafts cannot be checked against the grammar before the step
        limit = min(self.config.num_speculative_tokens, budget, self.max_model_len - seq.get_len() - 1)
        if params.max_tokens is not None:
            # The step emits up to drafts + 1 tokens; the last of max_tokens is never worth a draft.
            limit = min(limit, params.max_tokens - seq.get_output_len() - 1)
        if limit < 1:
            return []
        drafts = self.proposer.propose(_key(group, seq), seq.get_token_ids(), limit)
        if seq.grammar is not None and drafts:
            drafts = drafts[: grammar_accepted_prefix(seq.grammar, drafts)]
        return drafts

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """One verification: ``num_accepted`` of ``num_drafts`` drafts matched the target's tokens."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        seq.num_draft_tokens += num_drafts
        seq.num_accepted_tokens += num_accepted
        config = self.config
        if (seq.num_draft_tokens >= config.min_request_drafts
                and seq.num_accepted_tokens < config.min_request_acceptance * seq.num_draft_tokens):
            seq.spec_disabled = True  # its drafts cost more verification than they save
            self.num_requests_switched_off += 1

    def request_finished(self, group: SequenceGroup) -> None:
        for seq in group.get_seqs():
            self.proposer.request_finished(_key(group, seq), seq.get_token_ids(), seq.prompt_len)

    def get_stats(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
            "spec_decode_requests_switched_off": self.num_requests_switched_off,
        }
