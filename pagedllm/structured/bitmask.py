"""The sampler's side of structured outputs: grammar bitmasks applied to a batch of logits.

A row's bitmask is ``[ceil(V / 32)]`` int32 (xgrammar's layout: bit b of word w allows token
32 w + b); None leaves the row unconstrained.
"""

from __future__ import annotations

import torch

from pagedllm.kernels import cpu_kernels


def stack_bitmasks(bitmasks: list[torch.Tensor | None]) -> tuple[torch.Tensor, list[int]]:
    """``[rows, words]`` bitmasks (an unconstrained row allows everything) and the constrained rows."""
    indices = [i for i, mask in enumerate(bitmasks) if mask is not None]
    if len(indices) == len(bitmasks):
        return torch.stack(bitmasks), indices  # type: ignore[arg-type]
    allow_all = torch.full_like(bitmasks[indices[0]], -1)
    return torch.stack([allow_all if mask is None else mask for mask in bitmasks]), indices


def apply_token_bitmask(logits: torch.Tensor, bitmasks: list[torch.Tensor | None]) -> None:
    """Set to -inf, in place, the logits of the tokens each row's bitmask forbids (None: no constraint)."""
    import xgrammar as xgr

    stacked, indices = stack_bitmasks(bitmasks)
    kernels = _cpu_kernels_for(logits)
    if kernels is not None:
        # Ours skips whole words (most of a grammar's mask is zero words): several times xgrammar's CPU path.
        kernels.apply_token_bitmask(logits, stacked, indices)
        return
    xgr.apply_token_bitmask_inplace(logits, stacked.to(logits.device), vocab_size=logits.shape[1], indices=indices)


def greedy_pick_masked(
    logits: torch.Tensor, bitmasks: list[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Greedy choice under the bitmasks, ``logits`` left as they are: per row the argmax among the allowed
    tokens and its logprob over them (= argmax and log_softmax of the masked logits); None where our
    CPU kernel cannot serve (the caller masks, then picks).

    Reads only the allowed logits: a grammar allows a few tokens per step, so this costs a fraction
    of an unconstrained greedy choice, where masking first and picking after cost more than it.
    """
    kernels = _cpu_kernels_for(logits)
    if kernels is None or logits.shape[1] == 0:
        return None
    stacked, indices = stack_bitmasks(bitmasks)
    return getattr(torch.ops, kernels.__name__).greedy_pick_masked(logits, stacked, indices)


def _cpu_kernels_for(logits: torch.Tensor):
    """The compiled CPU kernels when they can serve ``logits`` (contiguous CPU float32), else None."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous():
        return None
    return cpu_kernels()
