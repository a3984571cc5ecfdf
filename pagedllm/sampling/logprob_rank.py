"""A reported logprob together with its token's rank in the vocabulary (vLLM's ``Logprob.rank``).

The rank of a token is 1 + the number of vocabulary entries with a strictly higher logprob, so it
needs the whole row: it is counted where the row exists (the sampler, prompt logprobs) and carried
with the value. The top-k entries beside it take their place among the top (1..k), as in vLLM.
"""

from __future__ import annotations

import torch


class RankedLogprob(float):
    """A logprob (a float wherever one is read: ``entry[token]``, comparisons, JSON) that also
    knows its token's ``rank`` (1 = the likeliest)."""

    __slots__ = ("rank",)
    rank: int

    def __new__(cls, value: float, rank: int) -> RankedLogprob:
        instance = super().__new__(cls, value)
        instance.rank = rank
        return instance

    def __reduce__(self) -> tuple[type[RankedLogprob], tuple[float, int]]:
        # Outputs cross processes (tensor-parallel ranks, data-parallel replicas): keep the rank.
        return RankedLogprob, (float(self), self.rank)


def vocab_ranks(logprobs: torch.Tensor, token_ids: torch.Tensor) -> list[int]:
    """Per row of ``logprobs`` [N, V]: the rank of ``token_ids[row]`` among all V entries."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    return ((logprobs > chosen).sum(dim=1) + 1).tolist()


def ranked_entry(
    token_id: int, logprob: float, rank: int, top_ids: list[int], top_values: list[float]
) -> dict[int, float]:
    """{the token: its logprob, then each top token: its logprob}, every value a RankedLogprob."""
    entry: dict[int, float] = {token_id: RankedLogprob(logprob, rank)}
    for place, (top_id, value) in enumerate(zip(top_ids, top_values, strict=True), 1):
        entry.setdefault(top_id, RankedLogprob(value, place))
    return entry
