"""The attention and sampling kernels' Python entry points: each returns None (or False) when the C++
kernel cannot serve the call, and the caller runs its torch code (the reference, and what runs on
a GPU)."""

from __future__ import annotations

import torch

from pagedllm.kernels.dispatch import cpu_kernels

# What the kernels take for "no sinks".
_NO_SINKS = torch.empty(0)

def _module_for(tensor: torch.Tensor):
    """The kernels' module when ``tensor`` is on the CPU and they are built, else None."""
    return cpu_kernels() if tensor.device.type == "cpu" else None


def _sinks_arg(sinks: torch.Tensor | None) -> torch.Tensor:
    return _NO_SINKS if sinks is None else sinks


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """[B, Hq, D] attention output, or None when the kernel cannot serve this call. The caches hold
    rows in the query's dtype, in bfloat16 / float16, or in a quantized format (attention/kv_quant.py), decoded as read.

    ``sliding_window`` > 0: only each sequence's last that many positions are attended;
    ``logits_soft_cap`` > 0: scores become cap * tanh(score / cap) before the softmax;
    ``sinks`` (float32 [Hq], GPT-OSS): per query head a logit that joins the softmax after the soft cap,
    in its max and denominator, with no value."""
    module = _module_for(query)
    if module is None:
        return None
    return module.paged_decode_attention(
        query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, logits_soft_cap, _sinks_arg(sinks)
    )


def paged_chunked_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """[T, Hq, D] causal attention of every query token over its sequence's cached context and
    itself (the step's K/V already written), or None when the kernel cannot serve this call.

    ``sliding_window``, ``logits_soft_cap`` and ``sinks`` as in ``paged_decode_attention`` (0, None: off)."""
    module = _module_for(query)
    if module is None:
        return None
    return module.paged_chunked_attention(
        query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, sliding_window, logits_soft_cap,
        _sinks_arg(sinks),
    )


def prompt_attention_amx_supported(query: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether ``prompt_attention_amx`` runs for these queries and cache here: bfloat16 queries over a
    bfloat16 or quantized cache (decoded to bfloat16 as it is packed), on a CPU with AMX, a head size
    that is a multiple of 64 (at most 256)."""
    if query.device.type != "cpu" or query.dtype != torch.bfloat16:
        return False
    if cache.dtype != torch.bfloat16 and cache.dtype.itemsize != 1:  # quantized pools are the 1-byte dtypes
        return False
    module = cpu_kernels()
    return module is not None and module.prompt_attention_amx_supported(query.shape[-1])


def prompt_attention_amx(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T, Hq, D] causal attention of prompt chunks over their cached context and themselves (the
    step's keys and values already written), on AMX tiles; only where
    ``prompt_attention_amx_supported``. ``sinks`` as in ``paged_decode_attention``."""
    return cpu_kernels().prompt_attention_amx(
        query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, _sinks_arg(sinks)
    )


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row of float32 or bfloat16 ``[N, V]`` logits: (argmax ids, their raw logprobs as float32),
    or None (no kernel)."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16) or logits.shape[1] == 0:
        return None
    module = cpu_kernels()
    if module is None:
        return None
    return module.greedy_pick(logits)
