"""PagedAttention, torch-native backend: runs unchanged on CPU and CUDA.

KV cache layout per layer: ``k_cache`` and ``v_cache`` shaped
``[num_blocks, block_size, num_kv_heads, head_dim]``. A token's slot is
``block_table[pos // block_size] * block_size + pos % block_size``; viewing the cache as
``[num_blocks * block_size, num_kv_heads, head_dim]`` makes the slot a row index, so the
"reshape and write into the cache" step is a single ``index_copy_``.

A batch mixes decodes (one query token) and prompt chunks (several query tokens after a
context already cached); each query token attends causally to every earlier token of its
sequence and to itself. The step's keys and values are written into the cache first, so a
chunk reads its own tokens and its earlier context alike, through the block table.

On CPU our C++ kernels (kernels/csrc) read each sequence's blocks in place: the decode
kernel for all-decode steps, the chunked kernel for mixed ones, except prompt chunks its vector
loops serve slowly: prompts with nothing cached and chunks of ``SDPA_MIN_CHUNK`` tokens or more
after a cached context. Those go, in bfloat16 on a CPU with AMX, to the tile kernel (blocks read
in place) up to ``AMX_MAX_CHUNK_PAIRS``; otherwise to torch's fused SDPA (over the step's own keys
and values, or over the gathered context).
Elsewhere, or when the kernels are unavailable, the torch-native path (the reference) gathers
the blocks into a temporary tensor for that step only. Nothing contiguous is kept between steps.

A quantized cache (``kv_cache_dtype``, attention/kv_quant.py) is read the same ways: the C++
kernels dequantize each row in registers as they read it, the torch path dequantizes the step's
gathered temporary. A prompt's own keys and values are then read back from the cache too, so every
token attends over the same quantized states whichever path serves it.

A layer with a sliding window W lets the query at position p see keys p - W + 1 .. p only; the
block manager may then have released blocks wholly before every layer's window, and their
table entries point at block 0: such positions are never read by the kernels and are masked out
in the torch paths. Attention soft-capping (Gemma 2) squashes the scores with cap * tanh(s / cap)
before the softmax. Attention sinks (GPT-OSS) add a learned logit per head to every softmax's
denominator, after the soft cap: a key that is always seen and contributes no value. The C++ kernels
take them; torch's fused SDPA does not, so on a CPU a sinks layer's prompt chunks that would go to
SDPA go to the AMX tile kernel (bfloat16, no pair limit) or the chunked kernel, and the torch path
(GPUs, or no kernels) computes its softmax explicitly. Under batch invariance the torch path's
decodes on a CPU attend one sequence at a time over its own context (not padded to the batch's
longest), so they do not depend on the batch; its prompt chunks attend a chunk at once
(kernels/invariance.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.kv_quant import cache_format, dequantize_rows, quantize_rows
from pagedllm.kernels import cpu_kernels
from pagedllm.kernels.attention import (
    paged_chunked_attention,
    paged_decode_attention,
    prompt_attention_amx,
    prompt_attention_amx_supported,
)
from pagedllm.kernels.codes import AMX_KERNEL, CHUNKED_KERNEL  # a CPU attention plan's kernels
from pagedllm.kernels.invariance import batch_invariant

# On CPUs, prompt chunks of at least this many tokens after a cached context attend through torch's
# SDPA over their gathered context rather than our chunked kernel (which stays for decodes and
# short chunks, where gathering the context would cost more than the attention).
SDPA_MIN_CHUNK = 64

# torch's fused SDPA on CPU in 16-bit floats runs query and key lengths that are not multiples of
# its block in a slow tail path: on a 2-core AMX machine a 437-token bfloat16 prompt took 4.0 ms per
# layer where 448 tokens took 1.6 ms (float32 shows no such step). Such lengths are padded to the
# next multiple; the padded keys are masked out and the padded queries' rows dropped.
SDPA_CPU_BLOCK = 32

# bfloat16 prompt chunks on a CPU with AMX go to our tile kernel (prompt_attention_amx) up to this
# many (query, key) pairs per chunk, counted as query tokens x keys seen by the last; beyond it
# torch's SDPA, whose fixed costs are amortised by then (benchmarks/prompt_attention.py on a 2-core
# AMX machine, ms per layer: 448 tokens 1.1 vs 2.3, 1,024 tokens 5.6 vs 8.8, a 250-token chunk after
# 1,750 cached 5.3 vs 8.1 with its context gathered, 2,048 tokens 20.4 vs 21.8: nearly level).
AMX_MAX_CHUNK_PAIRS = 2048 * 2048



def _sdpa_padding(q: torch.Tensor, length: int) -> int:
    """Rows to add to a query / key length of ``length`` before torch's CPU SDPA (0: none)."""
    if q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16):
        return 0
    return -length % SDPA_CPU_BLOCK


@dataclass
class AttentionMetadata:
    """Per-step batch description shared by every layer (built once by the model runner)."""

    slot_mapping: torch.Tensor  # [T] int64
    query_lens: list[int]  # per sequence: tokens computed this step
    query_start_loc: list[int]  # [B + 1] cumulative query lengths
    context_lens: torch.Tensor  # [B] int64 (device): cached + new tokens after this step
    block_tables: torch.Tensor  # [B, max_blocks] int64 (device), padded with 0
    num_cached_tokens: list[int]  # per sequence: tokens already in the cache before this step
    max_context_len: int
    # Filled lazily by the first layer that needs one (per sliding window; 0: none), reused by the others.
    decode_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # In a sub-batch (decode_part, sub_batch): its rows in the whole batch, a slice when they are
    # one run (the scheduler puts decodes first, then prompt chunks), so that reading and writing
    # them are a view and a copy rather than an index gather and scatter in every layer.
    decode_rows: torch.Tensor | slice | None = None
    _sub_batches: dict[tuple[int, ...], AttentionMetadata] = field(default_factory=dict, repr=False)
    _sdpa_splits: dict[int | None, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    # Derived once per step, by the first layer that needs them, then shared by all others.

    @cached_property
    def is_all_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @cached_property
    def query_start_loc_tensor(self) -> torch.Tensor:
        return torch.tensor(self.query_start_loc, dtype=torch.long, device=self.context_lens.device)

    @cached_property
    def decode_part(self) -> AttentionMetadata | None:
        """The decode rows of a mixed batch as a batch of their own (None when there are none)."""
        index = [i for i, n in enumerate(self.query_lens) if n == 1]
        return self.sub_batch(tuple(index)) if index else None

    def sdpa_split(self, window: int | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(sdpa, rest): sequences whose queries this step are a prompt chunk that torch's fused
        SDPA serves better than our chunked kernel, and every other sequence. A chunk with nothing
        cached (its keys and values are this step's own, no block read needed), or one of at least
        ``SDPA_MIN_CHUNK`` tokens after a cached context (its context gathered from the blocks),
        either with no window narrower than what it attends. Computed once per step and window,
        shared by the layers."""
        split = self._sdpa_splits.get(window)
        if split is None:
            sdpa = tuple(
                i for i, (n, c) in enumerate(zip(self.query_lens, self.num_cached_tokens))
                if n > 1 and (c == 0 or n >= SDPA_MIN_CHUNK) and (window is None or window >= n + c)
            )
            chosen = set(sdpa)
            rest = tuple(i for i in range(self.num_seqs) if i not in chosen)
            split = self._sdpa_splits[window] = (sdpa, rest)
        return split

    @cached_property
    def per_row(self) -> AttentionMetadata:
        """Every query row as a one-token sequence of its own, attending over its sequence's context
        up to and including itself: a prompt chunk's rows become decodes at their positions. The
        batch-invariant CPU path attends every row this way, so that a row's result is the same
        whichever step, batch or chunk it is computed in."""
        counts = torch.tensor(self.query_lens, dtype=torch.long, device=self.context_lens.device)
        owner = torch.repeat_interleave(torch.arange(self.num_seqs, device=counts.device), counts)
        starts = torch.tensor(self.query_start_loc[:-1], dtype=torch.long, device=counts.device)
        cached = torch.tensor(self.num_cached_tokens, dtype=torch.long, device=counts.device)
        total = self.query_start_loc[-1]
        within = torch.arange(total, device=counts.device) - starts[owner]
        lens = cached[owner] + within + 1
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            query_lens=[1] * total,
            query_start_loc=list(range(total + 1)),
            context_lens=lens,
            block_tables=self.block_tables[owner],
            num_cached_tokens=(lens - 1).tolist(),
            max_context_len=self.max_context_len,
        )

    def sub_batch(self, index: tuple[int, ...]) -> AttentionMetadata:
        """Sequences ``index`` as a batch of their own; ``decode_rows`` holds their rows in this batch."""
        part = self._sub_batches.get(index)
        if part is None:
            device = self.context_lens.device
            rows = [r for i in index for r in range(self.query_start_loc[i], self.query_start_loc[i + 1])]
            starts = [0]
            for i in index:
                starts.append(starts[-1] + self.query_lens[i])
            if rows and rows == list(range(rows[0], rows[0] + len(rows))):
                rows_t: torch.Tensor | slice = slice(rows[0], rows[0] + len(rows))
            else:
                rows_t = torch.tensor(rows, dtype=torch.long, device=device)
            index_t = torch.tensor(index, dtype=torch.long, device=device)
            part = self._sub_batches[index] = AttentionMetadata(
                slot_mapping=self.slot_mapping[rows_t],
                query_lens=[self.query_lens[i] for i in index],
                query_start_loc=starts,
                context_lens=self.context_lens[index_t],
                block_tables=self.block_tables[index_t],
                num_cached_tokens=[self.num_cached_tokens[i] for i in index],
                max_context_len=max(self.num_cached_tokens[i] + self.query_lens[i] for i in index),
                decode_rows=rows_t,
            )
        return part


def write_to_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    key_offset: torch.Tensor | None = None,
) -> None:
    """Scatter this step's keys/values ([T, Hkv, D]) into their slots; a quantized cache stores the
    keys less ``key_offset`` (float32 [Hkv, D], see attention/key_offset.py)."""
    if key.device.type == "cpu" and (kernels := cpu_kernels()) is not None:
        # Quantizes for a quantized cache.
        kernels.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, key_offset)
        return
    fmt = cache_format(k_cache)
    if fmt is None and key_offset is not None:
        raise ValueError("a key offset applies to a quantized KV cache only")
    if fmt is not None:
        key = quantize_rows(key, fmt, key_offset).view(torch.uint8)
        value = quantize_rows(value, fmt).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    num_kv_heads, row = k_cache.shape[-2], k_cache.shape[-1]
    # A 16-bit cache under a float32 model stores the states rounded to its type.
    k_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_from_cache(
    cache: torch.Tensor, block_tables: torch.Tensor, length: int, head_dim: int | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, length, Hkv, D] token states in logical order, in ``dtype``
    (None: the cache's). A quantized cache's rows are dequantized (``head_dim`` values each): the
    temporary holds this step's context only."""
    batch = block_tables.shape[0]
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    quantized = cache_format(cache) is not None
    source = cache.view(torch.uint8) if quantized else cache
    gathered = source[block_tables[:, :num_blocks]]  # [B, nb, bs, Hkv, row]
    rows = gathered.view(batch, num_blocks * block_size, cache.shape[2], cache.shape[3])[:, :length]
    if not quantized:
        return rows if dtype is None else rows.to(dtype)
    return dequantize_rows(rows.view(cache.dtype), head_dim, dtype)


class PagedAttention(nn.Module):
    """Multi-head / grouped-query attention over a paged KV cache."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}.")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # Per head: a logit joining each query's softmax denominator (GPT-OSS), loaded with the weights.
        self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False) if sinks else None
        # The fused C++ kernel reads blocks in place on CPU; tests switch it off to compare paths.
        self.use_cpu_kernel = True
        # Subtracted from every key a quantized cache stores (float32 [Hkv, D], attention/key_offset.py):
        # set by the worker's calibration pass for an integer cache, None otherwise.
        self.key_offset: torch.Tensor | None = None
        # A key_offset.KeyStatistics while a calibration pass runs, None otherwise.
        self.key_statistics = None

    @property
    def cpu_kernels_apply(self) -> bool:
        """Whether the C++ attention kernels may serve this layer (on a CPU, where they are built)."""
        return self.use_cpu_kernel

    @property
    def sink_logits(self) -> torch.Tensor | None:
        """The sinks as the C++ kernels take them, float32 (the torch path's softmax dtype); None: no sinks."""
        return None if self.sinks is None else self.sinks.detach().float().contiguous()

    @property
    def _plain_scores(self) -> bool:
        """Whether torch's fused SDPA computes this layer's softmax: no soft cap, no sinks."""
        return self.logits_soft_cap is None and self.sinks is None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        meta: AttentionMetadata | None,
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.key_statistics is not None:
            self.key_statistics.add(key)
        if kv_cache is not None:
            write_to_cache(key, value, kv_cache[0], kv_cache[1], meta.slot_mapping, self.key_offset)
        if meta is None or kv_cache is None:
            out = self._attend_new_tokens(query, key, value, meta)
        elif meta.is_all_decode:
            out = self._decode(query, kv_cache, meta)
        else:
            out = self._attend_mixed(query, key, value, kv_cache, meta)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def _attend_new_tokens(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata | None
    ) -> torch.Tensor:
        """Causal attention within each sequence's new tokens, nothing cached (e.g. profiling)."""
        starts = [0, query.shape[0]] if meta is None else meta.query_start_loc
        out = torch.empty_like(query)
        for i in range(len(starts) - 1):
            out[starts[i] : starts[i + 1]] = self._causal(query, key, value, starts[i], starts[i + 1])
        return out

    def _causal(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, start: int, end: int
    ) -> torch.Tensor:
        """Attention of new tokens start..end over themselves only (a sequence with nothing cached)."""
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        k = key[start:end].transpose(0, 1).unsqueeze(0)
        v = value[start:end].transpose(0, 1).unsqueeze(0)
        return self._attend_chunk(q, k, v, 0)

    def _attend_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int) -> torch.Tensor:
        """[n, H, D] output of a chunk's queries q ([1, H, n, D], at positions num_cached ..) over
        its keys/values k, v ([1, Hkv, num_cached + n, D], from position 0)."""
        num_new, total = q.shape[2], k.shape[2]
        window = self.sliding_window
        pad_q = pad_k = 0
        if self._plain_scores:  # the fused kernel's path
            pad_q, pad_k = _sdpa_padding(q, num_new), _sdpa_padding(q, total)
            if pad_q or pad_k:
                q = F.pad(q, (0, 0, 0, pad_q))
                k = F.pad(k, (0, 0, 0, pad_k))
                v = F.pad(v, (0, 0, 0, pad_k))
        if num_cached == 0 and (window is None or window >= total) and self._plain_scores:
            # Causal from the top left: a query never sees the keys padded after the last one.
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            # Query j sits at absolute position num_cached + j and sees keys max(0, pos - W + 1) .. pos;
            # a padded query repeats the last one's row (no row is empty; padded keys stay unseen).
            last = num_cached + num_new - 1
            q_pos = torch.arange(num_cached, last + 1 + pad_q, device=q.device).clamp(max=last).unsqueeze(1)
            k_pos = torch.arange(total + pad_k, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            attn = self._attend(q, k, v, mask)
        return attn[:, :, :num_new].squeeze(0).transpose(0, 1)

    def _attend_mixed(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Decodes and prompt chunks in one batch (each chunk after its cached context)."""
        if self.cpu_kernels_apply and query.device.type == "cpu":
            if batch_invariant() and cpu_kernels() is not None:  # each row as a decode (meta.per_row)
                out = self._decode(query, kv_cache, meta.per_row)
            else:
                out = self._attend_mixed_cpu(query, key, value, kv_cache, meta)
            if out is not None:
                return out
        out = torch.empty_like(query)
        decode = meta.decode_part
        if decode is not None:
            out[decode.decode_rows] = self._decode(query[decode.decode_rows], kv_cache, decode)
        for i, num_new in enumerate(meta.query_lens):
            if num_new > 1:
                self._attend_prompt_chunk(query, key, value, kv_cache, meta, i, out)
        return out

    def _attend_prompt_chunk(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        i: int,
        out: torch.Tensor,
    ) -> None:
        """Sequence i's prompt chunk through torch's SDPA, into its rows of ``out``: over the step's
        own keys and values when nothing is cached, else over its context and itself read from the
        cache (the chunk's own keys are there already; released blocks read as block 0 and fall
        outside the window mask)."""
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        if meta.num_cached_tokens[i] == 0 and kv_cache[0].dtype == query.dtype:
            out[start:end] = self._causal(query, key, value, start, end)
            return
        total = meta.num_cached_tokens[i] + end - start
        table = meta.block_tables[i : i + 1]
        k = gather_from_cache(kv_cache[0], table, total, self.head_dim, query.dtype).transpose(1, 2)
        v = gather_from_cache(kv_cache[1], table, total, self.head_dim, query.dtype).transpose(1, 2)
        q = query[start:end].transpose(0, 1).unsqueeze(0)
        out[start:end] = self._attend_chunk(q, k, v, meta.num_cached_tokens[i])

    def cpu_plan(
        self, meta: AttentionMetadata, query: torch.Tensor, cache: torch.Tensor
    ) -> tuple[list[tuple[int, AttentionMetadata]], tuple[int, ...]]:
        """How the CPU kernels split a mixed batch: (parts, sdpa). Each part is (kernel, batch): the
        whole batch, or a sub-batch whose ``decode_rows`` name its rows; CHUNKED_KERNEL takes decodes
        and short chunks after a cached context, AMX_KERNEL the prompt chunks the tile kernel serves
        where it runs for this query and cache (see ``_amx_chunks``). ``sdpa`` lists the
        sequences left to torch's fused SDPA (its flash kernel multiplies bfloat16 natively: ~5x our
        chunked kernel for a 448-token bfloat16 prompt, ~2x in float32). SDPA takes neither a soft cap
        nor sinks: such a layer leaves it nothing, the chunks the tiles do not take go to the chunked
        kernel. The Python path and the C++ decoder loop (models/layer_stack.py) both follow this plan."""
        sdpa, rest = ((), ()) if self.logits_soft_cap is not None else meta.sdpa_split(self.sliding_window)
        if not sdpa:
            return [(CHUNKED_KERNEL, meta)], ()
        tiled = self._amx_chunks(meta, sdpa) if prompt_attention_amx_supported(query, cache) else ()
        if len(tiled) == meta.num_seqs:  # prompts only, all on tiles
            return [(AMX_KERNEL, meta)], ()
        if self.sinks is not None and not tiled:  # with sinks the tiles take every chunk of sdpa, or none
            return [(CHUNKED_KERNEL, meta)], ()
        parts = []
        if tiled:
            parts.append((AMX_KERNEL, meta.sub_batch(tiled)))
        if rest:
            parts.append((CHUNKED_KERNEL, meta.sub_batch(rest)))
        return parts, tuple(i for i in sdpa if i not in tiled)

    def _attend_mixed_cpu(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """``cpu_plan`` carried out. None when the kernels are unavailable."""
        parts, sdpa = self.cpu_plan(meta, query, kv_cache[0])
        if len(parts) == 1 and parts[0][1] is meta and not sdpa:
            return self._cpu_kernel(parts[0][0], query, kv_cache, meta)
        out = torch.empty_like(query)
        for kernel, part in parts:
            attended = self._cpu_kernel(kernel, query[part.decode_rows], kv_cache, part)
            if attended is None:
                return None
            out[part.decode_rows] = attended
        for i in sdpa:
            self._attend_prompt_chunk(query, key, value, kv_cache, meta, i, out)
        return out

    def _cpu_kernel(
        self, kernel: int, query: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor | None:
        if kernel == AMX_KERNEL:
            return prompt_attention_amx(
                query, kv_cache[0], kv_cache[1], meta.block_tables, meta.query_start_loc_tensor, meta.context_lens,
                self.scale, self.sink_logits,
            )
        return paged_chunked_attention(
            query, kv_cache[0], kv_cache[1], meta.block_tables, meta.query_start_loc_tensor, meta.context_lens,
            self.scale, self.sliding_window or 0, self.logits_soft_cap or 0.0, self.sink_logits,
        )

    def _amx_chunks(self, meta: AttentionMetadata, chunks: tuple[int, ...]) -> tuple[int, ...]:
        """The prompt chunks of ``chunks`` (sequences without a window narrower than their span)
        that the AMX kernel serves: up to ``AMX_MAX_CHUNK_PAIRS``, where SDPA takes over; all of them
        with sinks, which SDPA does not take (the chunked kernel, the alternative, is slower)."""
        if not chunks or self.logits_soft_cap is not None:
            return ()
        if self.sinks is not None:
            return chunks
        return tuple(
            i for i in chunks
            if meta.query_lens[i] * (meta.num_cached_tokens[i] + meta.query_lens[i]) <= AMX_MAX_CHUNK_PAIRS
        )

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T * scale [soft-capped], masked [, sinks]) v over [B, H, q, D] / [B, Hkv, L, D]."""
        if self._plain_scores:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2))
        cap = self.logits_soft_cap
        scores = scores * self.scale if cap is None else torch.tanh(scores * (self.scale / cap)) * cap
        scores = scores.masked_fill(~mask, float("-inf")).float()
        if self.sinks is None:
            return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), v)
        # The sink as one more column of every row: it takes its share of the denominator, then is dropped.
        sink = self.sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        return torch.matmul(probs.to(q.dtype), v)

    def _decode(
        self, query: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """One query per sequence, attending over its blocks (the last W positions with a window)."""
        if self.cpu_kernels_apply:
            out = paged_decode_attention(
                query, kv_cache[0], kv_cache[1], meta.block_tables, meta.context_lens, self.scale,
                self.sliding_window or 0, self.logits_soft_cap or 0.0, self.sink_logits,
            )
            if out is not None:
                return out
        if meta.num_seqs > 1 and query.device.type == "cpu" and batch_invariant():
            # Each sequence over its own context, unpadded: a row's softmax and value sums then run
            # over the same length in the same order whatever else is in the step.
            return torch.cat([self._decode_torch(query[i:i + 1], kv_cache, meta.sub_batch((i,)))
                              for i in range(meta.num_seqs)])
        return self._decode_torch(query, kv_cache, meta)

    def _decode_torch(
        self, query: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """``_decode`` in torch: the batch's contexts gathered, padded to the longest and masked."""
        length = meta.max_context_len
        k = gather_from_cache(kv_cache[0], meta.block_tables, length, self.head_dim, query.dtype).transpose(1, 2)
        v = gather_from_cache(kv_cache[1], meta.block_tables, length, self.head_dim, query.dtype).transpose(1, 2)
        window = self.sliding_window or 0
        mask = meta.decode_masks.get(window)
        if mask is None:
            positions = torch.arange(length, device=query.device).unsqueeze(0)
            context_lens = meta.context_lens.unsqueeze(1)
            mask = positions < context_lens
            if window:
                mask &= positions >= context_lens - window
            mask = meta.decode_masks[window] = mask[:, None, None, :]
        return self._attend(query.unsqueeze(2), k, v, mask).squeeze(2)
