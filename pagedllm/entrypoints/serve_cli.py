"""`pagedllm serve`: the command line of the OpenAI-compatible server, its one owner.

The main CLI (entrypoints/cli.py) does ``add_serve_parser(subparsers)``; the parser it adds sets
``func=serve_main``, which gathers ServerSettings and calls ``run_server``. Importing this module
stays cheap (no torch) so ``--help`` is quick. ``python -m pagedllm.entrypoints.serve_cli`` takes
the same flags.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedllm.entrypoints.engine_flags import add_engine_args
from pagedllm.entrypoints.openai import defaults


def add_server_args(parser: argparse.ArgumentParser, model_positional: bool = True) -> None:
    """The server's own flags plus the engine's."""
    if model_positional:
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                            help="Hugging Face folder, GGUF file or hub id ORG/NAME[:QUANT] "
                                 "(default: the embedded SmolLM2-135M-Instruct).")
    parser.add_argument("--model", default=None, help="Same as the positional MODEL.")
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind (default loopback only).")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="Require 'Authorization: Bearer KEY' on /v1 routes (or set PAGEDLLM_API_KEY).")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="Model name(s) clients use (default: the model path).")
    limits = parser.add_argument_group("limits (see the README's Hardening section)")
    limits.add_argument("--max-request-bytes", type=int, default=defaults.DEFAULT_MAX_REQUEST_BYTES,
                        help="Larger request bodies get 413 (default 4 MiB).")
    limits.add_argument("--max-prompts-per-request", type=_positive_int,
                        default=defaults.DEFAULT_MAX_PROMPTS_PER_REQUEST,
                        help="More prompts in one /v1/completions request get 400 (default %(default)s).")
    limits.add_argument("--timeout-keep-alive", type=_positive_float, default=defaults.DEFAULT_TIMEOUT_KEEP_ALIVE,
                        help="Seconds an idle keep-alive connection stays open (default %(default)s).")
    limits.add_argument("--timeout-headers", type=_positive_float, default=defaults.DEFAULT_TIMEOUT_HEADERS,
                        help="Seconds a connection has to send a request's headers, from opening or from the "
                             "previous response; then it is closed (408) (default %(default)s).")
    limits.add_argument("--timeout-body", type=_positive_float, default=defaults.DEFAULT_TIMEOUT_BODY,
                        help="Seconds a request has to send its whole body; then 408 and the connection is "
                             "closed (default %(default)s).")
    limits.add_argument("--limit-concurrency", type=_positive_int, default=defaults.DEFAULT_LIMIT_CONCURRENCY,
                        help="Most open connections or requests in flight; beyond, 503 (default %(default)s).")
    chat = parser.add_argument_group("chat")
    chat.add_argument("--chat-template", default=None,
                      help="A Jinja chat template (a file, or the template text) instead of the tokenizer's.")
    chat.add_argument("--response-role", default="assistant",
                      help="The role of the replies of /v1/chat/completions (default %(default)s).")
    chat.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                      help="How tool calls are read out of replies (tool_choice auto): hermes (<tool_call> "
                           "blocks; Hermes, Qwen2.5) or llama3_json (a JSON object; Llama 3.1/3.2).")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help='Allow tool_choice "auto" (needs --tool-call-parser).')
    replicas = parser.add_argument_group("data-parallel replicas on Ray (see the README)")
    replicas.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=1,
                          help="Run this many whole engine replicas (each its own KV pool) as Ray actors behind this "
                               "server (default %(default)s: one engine in this process). Needs pagedllm[ray].")
    replicas.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                          help="ray: run the engine replicas as Ray actors (implied by --data-parallel-size > 1, "
                               "even with one replica); mp: tensor parallelism's worker processes only.")
    replicas.add_argument("--ray-address", default=None,
                          help="The Ray cluster to join (e.g. auto, or HOST:6379); default: RAY_ADDRESS, or a Ray "
                               "started on this machine.")
    replicas.add_argument("--router", default="prefix", choices=["prefix", "round_robin", "least_loaded"],
                          help="Which replica serves a request: prefix (the replica that cached the prompt's leading "
                               "blocks, unless it is overloaded), round_robin or least_loaded (default %(default)s; "
                               "pagedllm/core/router.py).")
    parser.add_argument("--root-path", default="",
                        help="The path prefix a proxy in front of the server strips (FastAPI's root_path).")
    parser.add_argument("--log-level", default="info", type=str.lower, choices=["debug", "info", "warning", "error"])
    parser.add_argument("--disable-log-requests", action="store_true", help="No log line per request.")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="Seconds to wait for connections to close on SIGINT/SIGTERM.")
    add_engine_args(parser, model_flag=False)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


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


def server_settings(args: argparse.Namespace) -> Any:
    """ServerSettings from parsed flags."""
    from pagedllm.distributed.data_parallel import DataParallelConfig, DataParallelUnavailableError
    from pagedllm.entrypoints.engine_flags import engine_args_from_cli
    from pagedllm.entrypoints.openai.settings import ServerSettings

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("pagedllm serve: --enable-auto-tool-choice needs --tool-call-parser.")
    engine_args = engine_args_from_cli(args)
    data_parallel = DataParallelConfig(
        data_parallel_size=args.data_parallel_size, distributed_executor_backend=args.distributed_executor_backend,
        ray_address=args.ray_address, router=args.router,
    )
    try:  # before the model loads: a missing Ray is named at once
        data_parallel.check(engine_args.tensor_parallel_size)
    except DataParallelUnavailableError as exc:
        raise SystemExit(f"pagedllm serve: {exc}") from None
    return ServerSettings(
        engine_args=engine_args,
        data_parallel=data_parallel,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_request_bytes=args.max_request_bytes,
        max_prompts_per_request=args.max_prompts_per_request,
        timeout_keep_alive=args.timeout_keep_alive,
        timeout_headers=args.timeout_headers,
        timeout_body=args.timeout_body,
        limit_concurrency=args.limit_concurrency,
        log_level=args.log_level,
        log_requests=not args.disable_log_requests,
        shutdown_timeout=args.shutdown_timeout,
        chat_template=args.chat_template,
        response_role=args.response_role,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        root_path=args.root_path,
    )


def serve_main(args: argparse.Namespace) -> None:
    # Bind before importing the server (torch and the model take seconds): a busy port fails at once.
    import logging

    from pagedllm.entrypoints.openai.http_limits import PortInUseError, bind_socket, is_serving_rank

    sock = None
    if is_serving_rank():
        try:
            sock = bind_socket(args.host, args.port)
        except PortInUseError as exc:
            logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
            logging.getLogger("pagedllm.api").error("%s", exc)
            raise SystemExit(1) from None
    from pagedllm.entrypoints.openai.api_server import run_server

    run_server(server_settings(args), sock)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.entrypoints.serve_cli",
                                     description="pagedllm OpenAI-compatible server")
    add_server_args(parser, model_positional=False)
    serve_main(parser.parse_args(argv))


if __name__ == "__main__":
    main()
