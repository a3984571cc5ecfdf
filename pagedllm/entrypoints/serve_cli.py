"""`pagedllm serve`: the command-line flags of the OpenAI-compatible server.

The main CLI (entrypoints/cli.py) does ``add_serve_parser(subparsers)``; the parser it adds sets
``func=serve_main``. Importing this module stays cheap (no torch) so ``--help`` is quick.
"""

from __future__ import annotations

import argparse
from typing import Any

DEFAULT_MAX_REQUEST_BYTES = 4 << 20


def _bool_flag(parser: argparse.ArgumentParser, name: str, default: bool, help_text: str) -> None:
    parser.add_argument(name, action=argparse.BooleanOptionalAction, default=default, help=help_text)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineArgs setting as a flag (names as vLLM's)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--tokenizer", default=None, help="Tokenizer folder if not the model's own.")
    group.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16.")
    group.add_argument("--block-size", type=int, default=16, help="Token slots per KV block.")
    group.add_argument("--kv-cache-memory", default=None,
                       help="Bytes for the KV pool, e.g. 2GiB or 512MiB (default: measured from free memory).")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (wins over memory).")
    group.add_argument("--swap-space", default="0", help="CPU memory for swapped-out blocks, e.g. 4GiB.")
    group.add_argument("--max-num-seqs", type=int, default=256, help="Most sequences in one step.")
    group.add_argument("--max-num-batched-tokens", type=int, default=None, help="Most tokens in one step.")
    group.add_argument("--max-model-len", type=int, default=None, help="Context length (default: the model's).")
    group.add_argument("--seed", type=int, default=0, help="Seed of the engine's random generator.")
    group.add_argument("--device", default="auto", help="auto, cpu or cuda[:N].")
    _bool_flag(group, "--enable-prefix-caching", True, "Share KV blocks of common prompt prefixes.")
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="Same as --no-enable-prefix-caching (the spelling of `pagedllm generate`).")
    group.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap", "auto"],
                       help="How preempted sequences come back.")
    group.add_argument("--num-threads", type=int, default=None, help="CPU threads for torch.")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="Split the model over this many ranks (worker processes, or torchrun's).")


def add_server_args(parser: argparse.ArgumentParser, model_positional: bool = True) -> None:
    """The server's own flags plus the engine's."""
    if model_positional:
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                            help="Hugging Face folder or GGUF file (default: the embedded SmolLM2-135M-Instruct).")
    parser.add_argument("--model", default=None, help="Same as the positional MODEL.")
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind (default loopback only).")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="Require 'Authorization: Bearer KEY' on /v1 routes (or set PAGEDLLM_API_KEY).")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="Model name(s) clients use (default: the model path).")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="Larger request bodies get 413.")
    parser.add_argument("--log-level", default="info", type=str.lower, choices=["debug", "info", "warning", "error"])
    parser.add_argument("--disable-log-requests", action="store_true", help="No log line per request.")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="Seconds to wait for connections to close on SIGINT/SIGTERM.")
    add_engine_args(parser)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to the main CLI's subparsers; it dispatches to serve_main."""
    parser = subparsers.add_parser(
        "serve",
        help="Run the OpenAI-compatible API server.",
        description="Serve a model over an OpenAI-compatible HTTP API (completions, chat, streaming, metrics).",
    )
    add_server_args(parser)
    parser.set_defaults(func=serve_main)
    return parser


def engine_args_from_cli(args: argparse.Namespace) -> Any:
    """EngineArgs from parsed flags."""
    from pagedllm.config import EngineArgs
    from pagedllm.entrypoints.llm import parse_bytes

    model = getattr(args, "model_tag", None) or args.model
    return EngineArgs(
        model=model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_memory=parse_bytes(args.kv_cache_memory),
        num_kv_blocks=args.num_kv_blocks,
        swap_space=parse_bytes(args.swap_space) or 0,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
        device=args.device,
        enable_prefix_caching=args.enable_prefix_caching,
        preemption_mode=args.preemption_mode,
        num_threads=args.num_threads,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def serve_main(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.openai.api_server import run_server

    run_server(args)
