"""Every engine setting as a command-line flag, shared by `generate`, `chat` and `serve`.

Importing this module stays cheap (no torch) so `pagedllm --help` is quick.
"""

from __future__ import annotations

import argparse
from typing import Any

# pagedllm.config imports no torch (the package imports it first anyway), so --help stays quick.
from pagedllm.config import KV_CACHE_DTYPES as _KV_CACHE_DTYPES


def add_hub_args(group: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """How a hub id is fetched (also `pagedllm download`'s flags)."""
    group.add_argument("--revision", default=None, help="Hub id: branch, tag or commit (default: main).")
    group.add_argument("--download-dir", default=None,
                       help="Hub id: the hub cache folder to download to and load from (default: HF_HOME's).")
    group.add_argument("--gguf-file", default=None,
                       help="GGUF repo (or folder): the .gguf file to load, when it holds several (or ID:QUANT).")


def add_engine_args(parser: argparse.ArgumentParser, model_flag: bool = True) -> None:
    """Flags named as vLLM's; the defaults are EngineArgs' defaults."""
    group = parser.add_argument_group("engine")
    if model_flag:
        group.add_argument("--model", default=None,
                           help="HF folder, GGUF file or hub id ORG/NAME[:QUANT] (default: embedded SmolLM2-135M).")
    add_hub_args(group)
    group.add_argument("--tokenizer", default=None, help="Tokenizer folder or hub id if not the model's own.")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    group.add_argument("--quantization", "-q", default=None,
                       choices=["int8", "int4", "int4-g32", "int4-g64", "int4-g128", "awq", "gptq", "gguf",
                                "dequantize"],
                       help="Weight-only quantization of a float checkpoint at load time (int4: groups of 128 "
                            "unless -gNN). AWQ / GPTQ checkpoints and GGUF files keep their own packed types "
                            "without it ('awq' / 'gptq' only confirm it); 'dequantize' loads a GGUF as float32 "
                            "instead.")
    group.add_argument("--int8-activations", action=argparse.BooleanOptionalAction, default=None,
                       help="Quantized weights: multiply with activations quantized to int8 (integer dot "
                            "products; default: wherever the CPU has them). --no-int8-activations keeps "
                            "float activations (exactly the dequantized model's results).")
    group.add_argument("--block-size", type=int, default=16, help="Token slots per KV block.")
    group.add_argument("--kv-cache-memory", default=None,
                       help="Bytes for the KV pool, e.g. 2GiB or 512MiB (default: a share of free memory).")
    group.add_argument("--kv-cache-dtype", default="auto", choices=list(_KV_CACHE_DTYPES),
                       help="KV cache storage: auto (the model dtype), fp8 (= fp8_e4m3), fp8_e5m2, int8 or int4, "
                       "each with scales per token and KV head (int4: per 32 values); 8 bits hold ~1.94x the "
                       "tokens of bfloat16 in the same memory, int4 ~3.2x.")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (wins over memory).")
    group.add_argument("--swap-space", default="0", help="CPU memory for swapped-out blocks, e.g. 4GiB.")
    group.add_argument("--max-num-seqs", type=int, default=256, help="Most sequences in one step.")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="Token budget of one step (default: 512 with chunked prefill, "
                       "else max(max_model_len, 8192)).")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                       help="Share each step's token budget between decodes and prompt chunks (off: a step is all "
                       "prefill or all decode, as in the paper).")
    group.add_argument("--long-prefill-token-threshold", type=int, default=0,
                       help="With chunked prefill: the most prompt tokens one request computes in a step "
                       "(0: no limit but the step budget).")
    group.add_argument("--long-prompt-chunk-tokens", type=int, default=256,
                       help="With chunked prefill: the most tokens per step of a prompt longer than the step budget "
                       "(prompts within the budget run whole; 0: no limit but the budget).")
    group.add_argument("--max-prefill-tokens-while-decoding", type=int, default=0,
                       help="With chunked prefill: the most prompt tokens in all of a step that also decodes, which "
                       "bounds how long a prompt holds up running streams (0: no limit but the budget).")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help="Speculative decoding in vLLM's JSON form, e.g. "
                       "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5, \"prompt_lookup_max\": 4}', method "
                       "\"suffix\", or '{\"method\": \"draft_model\", \"model\": PATH_OR_ID}' (a smaller model with "
                       "the same tokenizer); greedy output stays the same, sampling the same distribution.")
    group.add_argument("--max-model-len", type=int, default=None, help="Context length (default: the model's).")
    group.add_argument("--seed", type=int, default=0, help="Seed of the engine's random generator.")
    group.add_argument("--device", default="auto", help="auto, cpu or cuda[:N].")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="Share KV blocks of common prompt prefixes.")
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="Same as --no-enable-prefix-caching.")
    group.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap", "auto"],
                       help="How preempted sequences come back.")
    group.add_argument("--kv-allocation", default="paged",
                       choices=["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"],
                       help="Paged blocks (ours) or one of the paper's contiguous reservation baselines.")
    group.add_argument("--batching", default="iteration", choices=["iteration", "request"],
                       help="Iteration-level (continuous) or request-level (static) batching.")
    group.add_argument("--track-kv-waste", action="store_true", help="Account KV memory waste every step.")
    group.add_argument("--num-threads", type=int, default=None, help="CPU threads for torch.")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="Split the model over this many ranks (worker processes, or torchrun's).")


def engine_args_from_cli(args: argparse.Namespace) -> Any:
    """EngineArgs from parsed flags (a positional MODEL, where the command has one, wins)."""
    from pagedllm.config import EngineArgs, parse_bytes

    return EngineArgs(
        model=getattr(args, "model_tag", None) or args.model,
        tokenizer=args.tokenizer,
        revision=args.revision,
        download_dir=args.download_dir,
        gguf_file=args.gguf_file,
        dtype=args.dtype,
        quantization=args.quantization,
        int8_activations=args.int8_activations,
        block_size=args.block_size,
        kv_cache_memory=parse_bytes(args.kv_cache_memory),
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_dtype=args.kv_cache_dtype,
        swap_space=parse_bytes(args.swap_space) or 0,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
        device=args.device,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        long_prompt_chunk_tokens=args.long_prompt_chunk_tokens,
        max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
        speculative_config=args.speculative_config,
        preemption_mode=args.preemption_mode,
        kv_allocation=args.kv_allocation,
        batching=args.batching,
        track_kv_waste=args.track_kv_waste,
        num_threads=args.num_threads,
        tensor_parallel_size=args.tensor_parallel_size,
    )
