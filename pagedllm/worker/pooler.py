"""Pooling a prompt's final hidden states into one embedding, chunk by chunk.

A prompt may be computed over several steps (chunked prefill, or again after a recompute
preemption), so pooling is split in two: each step the model runner reduces the chunk it computed
to a ``PooledChunk`` (LAST: the chunk's last row; CLS: the first row when the chunk starts the prompt;
MEAN: the float32 sum of the rows and their count), and the engine folds the chunks of a request
into its running state with ``accumulate``. ``finish`` turns the state into the embedding: the mean
divided out, Matryoshka truncation to ``dimensions``, then L2 normalization. The result is the same
whether or not the prompt was chunked (up to float32 summation order for MEAN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.pooling_params import PoolingParams


@dataclass
class PooledChunk:
    """One step's reduction of one sequence's hidden rows (float32, on the CPU)."""

    start_pos: int  # the chunk's first position: 0 starts (or restarts) the prompt
    value: torch.Tensor | None  # [hidden]: the last row, the first row, or the sum; None: nothing to keep
    num_tokens: int


def pool_chunks(hidden: torch.Tensor, chunks: list[tuple[int, int, int, str]]) -> list[PooledChunk]:
    """Reduce each (first row in ``hidden``, rows, start position, pooling type) chunk, in one copy to the CPU."""
    rows: list[torch.Tensor] = []
    for first, num_rows, _, pooling_type in chunks:
        if pooling_type == "LAST":
            rows.append(hidden[first + num_rows - 1].float())
        elif pooling_type == "CLS":
            # A chunk that does not start the prompt has no first token: a placeholder row, dropped below.
            rows.append(hidden[first].float())
        elif pooling_type == "MEAN":
            rows.append(hidden[first : first + num_rows].float().sum(dim=0))
        else:
            raise ValueError(f"unknown pooling type {pooling_type!r}")
    if not rows:
        return []
    values = torch.stack(rows).cpu()
    return [
        PooledChunk(start_pos, None if pooling_type == "CLS" and start_pos else values[i], num_rows)
        for i, (_, num_rows, start_pos, pooling_type) in enumerate(chunks)
    ]


@dataclass
class PoolingState:
    """A request's pooling so far: the kept row (LAST, CLS) or the running sum (MEAN), and tokens seen."""

    value: torch.Tensor | None = None
    num_tokens: int = 0


def accumulate(state: PoolingState | None, chunk: PooledChunk, pooling_type: str) -> PoolingState:
    """Fold the next chunk in; a chunk at position 0 starts over (the prompt is being recomputed)."""
    if state is None or chunk.start_pos == 0:
        state = PoolingState()
    if pooling_type == "MEAN":
        assert chunk.value is not None
        state.value = chunk.value if state.value is None else state.value + chunk.value
    elif pooling_type == "LAST" or chunk.value is not None:  # CLS keeps the first chunk's row
        state.value = chunk.value
    state.num_tokens += chunk.num_tokens
    return state


def finish(state: PoolingState | None, pooling_type: str, params: PoolingParams, normalize: bool) -> torch.Tensor:
    """The embedding [hidden or dimensions], float32: mean divided out, truncated, then normalized."""
    if state is None or state.value is None:
        raise RuntimeError("the request's prompt finished without pooled hidden states")
    embedding = state.value / state.num_tokens if pooling_type == "MEAN" else state.value
    if params.dimensions is not None:
        embedding = embedding[: params.dimensions]
    if params.normalize if params.normalize is not None else normalize:
        embedding = F.normalize(embedding, p=2, dim=-1)
    return embedding
