"""Batch invariance: a sequence's logits do not depend on the other rows of its step, on how its
prompt was split into chunks, nor on prefix-cache hits (``kernel_config().batch_invariant``, on by
default; vLLM's ``VLLM_BATCH_INVARIANT``). Greedy and seeded requests then give the same answer
alone and under any load.

Each CPU kernel whose arithmetic depended on the step's row counts computes every row one way:

- Attention: every query row, a decode or a prompt token, goes through the decode kernel as a
  one-token query over its own context (``AttentionMetadata.per_row``): one softmax over that
  row's keys in one order, a layer's sink logits (GPT-OSS) in it too. Mixed steps used to send
  decodes through the chunked kernel (another summation order) and prompt chunks to torch's SDPA or
  the AMX tile kernel by chunk length.
- Packed quantized weights with float activations (``quant_linear``): one per-row summation order
  at every row count, where 1-4 rows, 5-48 rows and more each took a kernel of their own.
- int8 activations: no switch to AMX bfloat16 products from ``int8_amx_min_rows`` rows on.
- bfloat16 weights: our panel kernel wherever this level has it, rather than oneDNN (whose
  products of one row differ from the same row among others for some shapes).

- Decodes on the torch attention path on a CPU (a layer with the kernels switched off, or none
  built) and multi-head latent attention's decodes (DeepSeek-V3, attention/mla.py): one sequence
  at a time over its own context, where padding every context to the batch's longest changed a
  row's sums. With 64 decodes over ~1,000 tokens this was faster for a GPT-OSS-20B-shaped sinks
  layer on the torch path (0.20 s vs 0.95 s per layer on a 2-core EPYC: the padded gather was the
  cost; sinks layers now take the decode kernel) and slower for a DeepSeek-V3-shaped latent layer
  (0.42 s vs 0.26 s; 8 decodes 78 vs 42 ms).
- MoE routers (GPT-OSS, Qwen-MoE, DeepSeek), plain float linears kept out of packing: through the
  panel kernel (layers/cpu_gemm.py ``row_invariant_linear``); DeepSeek's router sigmoid in float64.

The panel kernels (float32 and bfloat16), int8 dot products, norms, rotary and greedy choice
compute each row independently of the others (tests/test_batch_invariance.py checks every linear
product's rows alone and in batches at every level). Not covered: float32 weights below the
AVX-512 levels, which only oneDNN multiplies there (one row of a 576 x 1536 product differed from
the same row among others), torch's F.linear (``gemm="torch"``), prompt chunks on the torch
attention path and latent attention's (each chunk attends at once, so a prompt split into other
chunks, or after a prefix-cache hit, can differ in the last bits, and with it the request when the
step budget splits it differently under load; attending each prompt token alone in torch cost 3x
a 512-token prompt's attention and 6x a 256-token chunk's after 768 cached), torch's elementwise
functions where a row does not fill whole vectors (a tensor's tail goes through scalar code), and
GPUs. What it costs is measured by benchmarks/batch_invariance.py; ``batch_invariant=False``
(``PAGEDLLM_BATCH_INVARIANT=0``) restores the per-batch choices.
"""

from __future__ import annotations

from pagedllm.kernels.config import kernel_config


def batch_invariant() -> bool:
    return kernel_config().batch_invariant


def int8_amx_min_rows() -> int:
    """Rows from which int8-tiled products run on AMX in bfloat16 (0: never)."""
    return 0 if batch_invariant() else kernel_config().int8_amx_min_rows
