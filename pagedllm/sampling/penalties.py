"""Logits processors applied before sampling, vectorised over the batch.

Each function takes the ``[N, V]`` logits of a batch and edits them in place. Token lists of
different lengths are padded with ``V`` (one column past the vocabulary) and scattered into a
``[N, V + 1]`` tensor whose extra column is dropped: no Python loop ever touches the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[N, V]`` float32 counts of each token id in each row's list (ids outside ``[0, V)`` ignored)."""
    num_rows = len(token_lists)
    max_len = max((len(tokens) for tokens in token_lists), default=0)
    counts = torch.zeros((num_rows, vocab_size + 1), dtype=torch.float32, device=device)
    if max_len == 0:
        return counts[:, :vocab_size]
    padded = torch.full((num_rows, max_len), vocab_size, dtype=torch.int64)
    for row, tokens in enumerate(token_lists):
        if tokens:
            padded[row, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.int64)
    padded = padded.to(device)
    # Out-of-range ids land in the dropped padding column.
    padded = torch.where((padded < 0) | (padded > vocab_size), vocab_size, padded)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalties: torch.Tensor) -> None:
    """Hugging Face semantics (CTRL paper): for every token already seen (prompt or output),
    divide a positive logit by the penalty and multiply a negative one by it.

    ``seen``: ``[N, V]`` bool; ``penalties``: ``[N]`` (1.0 leaves a row unchanged).
    """
    penalties = penalties.unsqueeze(1)
    penalised = torch.where(logits < 0, logits * penalties, logits / penalties)
    torch.where(seen, penalised, logits, out=logits)


def apply_presence_frequency_penalties(
    logits: torch.Tensor, output_counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> None:
    """OpenAI semantics over generated tokens: ``logit -= frequency * count + presence * (count > 0)``.

    ``output_counts``: ``[N, V]`` counts of each token among the row's generated tokens;
    ``presence``/``frequency``: ``[N]``.
    """
    logits -= frequency.unsqueeze(1) * output_counts
    logits -= presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def apply_min_tokens(logits: torch.Tensor, banned: Sequence[Sequence[int]]) -> None:
    """Forbid, row by row, the given token ids (EOS and stop tokens while ``min_tokens`` is not reached)."""
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for row, token_ids in enumerate(banned):
        for token_id in token_ids:
            if 0 <= token_id < vocab_size:
                rows.append(row)
                cols.append(token_id)
    if rows:
        index = (torch.as_tensor(rows, device=logits.device), torch.as_tensor(cols, device=logits.device))
        logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))


# top-k / top-p look at this many best tokens first; a full sort of the vocabulary happens only for
# rows whose nucleus is not inside them. Sorting 49k entries per row costs ~20x a top-1024.
NUCLEUS_CANDIDATES = 1024


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask to ``-inf`` every token outside the row's top ``k`` and then outside its nucleus ``p``.

    ``top_k``: ``[N]`` int64 (``V`` disables); ``top_p``: ``[N]`` (1.0 disables). Exactly ``k`` tokens
    survive top-k (ties broken by the sort); the nucleus is the smallest prefix of the sorted,
    top-k-renormalised distribution whose mass reaches ``p``, never empty.
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    k = top_k if top_k is not None else torch.full((num_rows,), vocab_size, dtype=torch.int64, device=device)
    p = top_p if top_p is not None else torch.ones(num_rows, dtype=logits.dtype, device=device)
    has_k = k < vocab_size
    has_p = p < 1.0
    filtered = has_k | has_p
    if not bool(filtered.any()):
        return logits
    max_k = int(torch.where(has_k, k, 0).max())
    num_candidates = max(NUCLEUS_CANDIDATES, max_k)
    if num_candidates >= vocab_size:
        return _top_k_top_p_full_sort(logits, k, p)
    cand_logits, cand_index = logits.topk(num_candidates, dim=-1)  # sorted, descending
    ranks = torch.arange(num_candidates, device=device).unsqueeze(0)
    keep = ranks < k.unsqueeze(1)
    cand_logits = cand_logits.masked_fill(~keep, float("-inf"))
    needs_full_sort = torch.zeros(num_rows, dtype=torch.bool, device=device)
    if top_p is not None:
        # Probabilities over the row's whole distribution: renormalised within top-k when set (all of
        # the top k are candidates), else relative to the full vocabulary.
        log_norm = torch.where(has_k, cand_logits.logsumexp(dim=-1), logits.logsumexp(dim=-1))
        cand_probs = (cand_logits - log_norm.unsqueeze(1)).exp()
        mass_before = cand_probs.cumsum(dim=-1) - cand_probs
        limit = torch.where(has_p, p.to(cand_probs.dtype), float("inf"))
        keep &= mass_before < limit.unsqueeze(1)
        keep[:, 0] = True  # the most likely token always stays
        # A nucleus that may reach past the candidates needs the full sort.
        needs_full_sort = has_p & ~has_k & (cand_probs.sum(dim=-1) < limit)
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, cand_index, keep)
    kept |= ~filtered.unsqueeze(1)  # rows without a filter keep everything
    result = logits.masked_fill(~kept, float("-inf"))
    if bool(needs_full_sort.any()):
        rows = needs_full_sort.nonzero().squeeze(1)
        result[rows] = _top_k_top_p_full_sort(logits[rows], k[rows], p[rows])
    return result


def _top_k_top_p_full_sort(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
    vocab_size = logits.shape[1]
    ranks = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
    sorted_logits.masked_fill_(ranks >= top_k.unsqueeze(1), float("-inf"))
    # The candidate path's probabilities, rounding included (normalised over the top k when set,
    # else over the unsorted row), so that both put a token on the same side of the boundary p.
    has_k = top_k < vocab_size
    log_norm = torch.where(has_k, sorted_logits.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    sorted_probs = (sorted_logits - log_norm.unsqueeze(1)).exp()
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # p = 1 must keep everything, even where rounding lets the cumulative sum reach 1 early.
    limit = torch.where(top_p >= 1.0, float("inf"), top_p.to(sorted_probs.dtype))
    outside = mass_before >= limit.unsqueeze(1)
    outside[:, 0] = False
    sorted_logits.masked_fill_(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_index, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's highest probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))
