"""`pagedllm serve`: the command-line flags of the OpenAI-compatible server.

The main CLI (entrypoints/cli.py) does ``add_serve_parser(subparsers)``; the parser it adds sets
``func=serve_main``. Importing this module stays cheap (no torch) so ``--help`` is quick.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedllm.entrypoints.engine_flags import add_engine_args

DEFAULT_MAX_REQUEST_BYTES = 4 << 20


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
    add_engine_args(parser, model_flag=False)


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


def serve_main(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.openai.api_server import run_server

    run_server(args)
