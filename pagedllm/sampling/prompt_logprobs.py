"""Log-probabilities of the prompt's own tokens (vLLM's prompt_logprobs; lm-eval's log-likelihoods).

The hidden state at prompt position ``p`` predicts the token at ``p + 1``: a step's positions give one
entry per prompt token they predict (the last position of a whole prompt predicts the first generated
token instead; that of a prompt chunk, the next chunk's first token). Logits are computed in
chunks of rows so that a long prompt never holds a ``[prompt_len, vocab]`` tensor at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from pagedllm.sampling.logprob_rank import ranked_entry, vocab_ranks

CHUNK_ROWS = 256


def prompt_row_chunks(hidden_start: int, num_targets: int) -> Iterator[range]:
    """The hidden rows (flattened batch indices) to take logits of, chunk by chunk."""
    last = hidden_start + num_targets
    for start in range(hidden_start, last, CHUNK_ROWS):
        yield range(start, min(start + CHUNK_ROWS, last))


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    hidden_start: int,
    targets: list[int],
    top_k: int,
    vocab_size: int,
) -> list[dict[int, float]]:
    """Per target token (the one each row, from ``hidden_start``, predicts): {the token: its logprob}
    plus the ``top_k`` most likely tokens, each value a RankedLogprob (the target's rank is in the
    whole vocabulary, whether or not it is among the top)."""
    result: list[dict[int, float]] = []
    for rows in prompt_row_chunks(hidden_start, len(targets)):
        index = torch.arange(rows.start, rows.stop, device=hidden.device)
        logprobs = torch.log_softmax(compute_logits(hidden.index_select(0, index))[:, :vocab_size].float(), dim=-1)
        first = rows.start - hidden_start
        chunk_targets = torch.tensor(targets[first : first + len(rows)], device=logprobs.device)
        chosen = logprobs.gather(1, chunk_targets.unsqueeze(1)).squeeze(1).tolist()
        ranks = vocab_ranks(logprobs, chunk_targets)
        top_ids: list[list[int]] = [[] for _ in rows]
        top_values: list[list[float]] = [[] for _ in rows]
        if top_k > 0:
            values, ids = logprobs.topk(min(top_k, logprobs.shape[1]), dim=-1)
            top_ids, top_values = ids.tolist(), values.tolist()
        for target, value, rank, ids_row, values_row in zip(chunk_targets.tolist(), chosen, ranks, top_ids, top_values):
            result.append(ranked_entry(target, value, rank, ids_row, values_row))
    return result
