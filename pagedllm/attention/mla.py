"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latent rows, in torch.

Per token and layer the cache holds ONE row: the normalised compressed KV ``c`` (``kv_lora_rank``
values) followed by the rotated rope key ``k_pe`` that every head shares (``qk_rope_head_dim``),
in a pool ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``; a token's slot is
found through the block table as for K and V (backend.py). The per-head keys and values are
``kv_b_proj``'s rows applied to ``c``: ``W_UK`` (``qk_nope_head_dim`` rows per head) and ``W_UV``
(``v_head_dim`` rows per head).

Decodes use the weight-absorbed form, which never expands the context: the query moves into
latent space (``q_nope W_UK``, per head), so a head's score is ``(q_nope W_UK) . c + q_pe . k_pe``,
one product with the cached row; the output stays latent (``probs . c``) until ``W_UV`` maps it to
the head's value space. Prompt chunks, whose many queries would each pay that per-head move over
the whole context, expand their context's rows into K and V once and run torch's SDPA, causal
within the chunk. Both read the step's own rows from the cache, which is written first.

Only a float cache is supported, in the model dtype or a 16-bit type ("bfloat16", "float16": rows
are read back in the model dtype); kv_spec.py refuses a quantized one. Under
batch invariance (kernels/invariance.py) on a CPU, decodes attend one sequence at a time over its
own context, so a decode's result does not follow the batch; a prompt chunk's still follows how the
prompt was split (a row in a chunk is reduced with the chunk's other rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.kernels.invariance import batch_invariant


def write_latent(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's latent rows ([T, width]) into their slots of a latent pool."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, rows.to(cache.dtype))


def gather_latent(cache: torch.Tensor, block_tables: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, length, width] latent rows in logical order, in ``dtype`` (a
    temporary holding this step's context only)."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    gathered = cache[block_tables[:, :num_blocks]]  # [B, nb, bs, 1, width]
    return gathered.view(block_tables.shape[0], num_blocks * block_size, cache.shape[-1])[:, :length].to(dtype)


class MultiHeadLatentAttention(nn.Module):
    """Attention of ``num_heads`` heads whose keys and values come from one latent row per token."""

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.nope_dim = qk_nope_head_dim
        self.rope_dim = qk_rope_head_dim
        self.v_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                kv_b_weight: torch.Tensor, kv_cache: tuple[torch.Tensor, ...] | None,
                meta: AttentionMetadata | None) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (rotated), latent [T, rank] (normalised), k_pe
        [T, rope] (rotated), kv_b_weight [H * (nope + v), rank] -> [T, H * v]."""
        num_tokens = q_nope.shape[0]
        rows = torch.cat((latent, k_pe), dim=-1)
        if kv_cache is None or meta is None:  # profiling: one sequence, nothing cached
            out = self._expanded(q_nope, q_pe, rows, kv_b_weight, 0)
            return out.reshape(num_tokens, -1)
        cache = kv_cache[0]
        write_latent(rows, cache, meta.slot_mapping)
        if meta.is_all_decode:
            return self._absorbed_decode(q_nope, q_pe, kv_b_weight, cache, meta).reshape(num_tokens, -1)
        out = q_nope.new_empty(num_tokens, self.num_heads, self.v_dim)
        decode = meta.decode_part
        if decode is not None:
            rows_of = decode.decode_rows
            out[rows_of] = self._absorbed_decode(q_nope[rows_of], q_pe[rows_of], kv_b_weight, cache, decode)
        for i, num_new in enumerate(meta.query_lens):
            if num_new > 1:
                start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
                cached = meta.num_cached_tokens[i]
                # With nothing cached the chunk's own rows, as stored, are its whole context: no gather needed.
                context = (rows[start:end].to(cache.dtype).to(rows.dtype) if cached == 0
                           else gather_latent(cache, meta.block_tables[i:i + 1], cached + num_new, rows.dtype)[0])
                out[start:end] = self._expanded(q_nope[start:end], q_pe[start:end], context, kv_b_weight, cached)
        return out.reshape(num_tokens, -1)

    def _split_kv_b(self, kv_b_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, rank], W_UV [H, v, rank]): kv_b_proj's rows per head."""
        per_head = kv_b_weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return per_head[:, :self.nope_dim], per_head[:, self.nope_dim:]

    def _absorbed_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_b_weight: torch.Tensor,
                         cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One query per sequence over its cached latent rows -> [B, H, v], never expanding them."""
        if meta.num_seqs > 1 and q_nope.device.type == "cpu" and batch_invariant():
            # Each sequence alone, over its own context unpadded: every product and reduction of a row
            # then has the same shapes, so the same order, whatever else is in the step.
            return torch.cat([self._absorbed_decode_batch(q_nope[i:i + 1], q_pe[i:i + 1], kv_b_weight, cache,
                                                          meta.sub_batch((i,)))
                              for i in range(meta.num_seqs)])
        return self._absorbed_decode_batch(q_nope, q_pe, kv_b_weight, cache, meta)

    def _absorbed_decode_batch(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_b_weight: torch.Tensor,
                               cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``_absorbed_decode`` of the whole batch at once, contexts padded to the longest."""
        w_uk, w_uv = self._split_kv_b(kv_b_weight)
        q_latent = torch.einsum("bhn,hnc->bhc", q_nope, w_uk)
        query = torch.cat((q_latent, q_pe), dim=-1)  # [B, H, rank + rope]: scores against the whole row
        context = gather_latent(cache, meta.block_tables, meta.max_context_len, query.dtype)  # [B, L, rank + rope]
        scores = torch.matmul(query, context.transpose(1, 2)) * self.scale  # [B, H, L]
        positions = torch.arange(context.shape[1], device=query.device)
        past_end = positions[None, :] >= meta.context_lens[:, None]  # padding of shorter sequences
        scores = scores.masked_fill(past_end[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out_latent = torch.matmul(probs, context[..., :self.kv_lora_rank])  # [B, H, rank]
        return torch.einsum("bhc,hvc->bhv", out_latent, w_uv)

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, context: torch.Tensor,
                  kv_b_weight: torch.Tensor, cached: int) -> torch.Tensor:
        """One sequence's chunk of queries [n, H, *] after ``cached`` tokens over its context rows
        [cached + n, rank + rope], expanded into per-head K and V -> [n, H, v]."""
        length = context.shape[0]
        kv = F.linear(context[:, :self.kv_lora_rank], kv_b_weight).view(length, self.num_heads, -1)
        k_nope, value = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_pe = context[:, None, self.kv_lora_rank:].expand(length, self.num_heads, self.rope_dim)
        key = torch.cat((k_nope, k_pe), dim=-1)
        query = torch.cat((q_nope, q_pe), dim=-1)
        num_new = query.shape[0]
        # Query j sits at position cached + j and sees every key up to and including it.
        mask = (torch.arange(length, device=query.device)[None, :]
                <= cached + torch.arange(num_new, device=query.device)[:, None])
        out = F.scaled_dot_product_attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                                             attn_mask=mask, scale=self.scale)
        return out.transpose(0, 1)
