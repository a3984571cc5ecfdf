"""`pagedllm serve`: the command line of the OpenAI-compatible server, its one owner.

The main CLI (entrypoints/cli.py) does ``add_serve_parser(subparsers)``; the parser it adds sets
``func=serve_main``, which gathers ServerSettings and calls ``run_server``. Importing this module
stays cheap (no torch) so ``--help`` is quick. ``python -m pagedllm.entrypoints.serve_cli`` takes
the same flags.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from pagedllm.config import SERVER_ARG_GROUPS
from pagedllm.entrypoints.engine_flags import (
    add_engine_args,
    add_field_flag,
    declared_settings,
    engine_arg_fields,
    engine_args_from_cli,
)
from pagedllm.entrypoints.openai.settings import ServerSettings
from pagedllm.serving.data_parallel import DataParallelConfig, DataParallelUnavailableError


def add_server_args(parser: argparse.ArgumentParser, model_positional: bool = True) -> None:
    """The server's own flags (ServerSettings' and DataParallelConfig's fields declared with setting(), in
    SERVER_ARG_GROUPS) plus the engine's; serve's --distributed-executor-backend feeds EngineArgs' field too."""
    model_spec = engine_arg_fields()["model"]
    if model_positional:
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=model_spec.metadata["help"])
    add_field_flag(parser, model_spec)
    # The first group's flags sit in the parser's own options list, next to MODEL.
    containers: dict[str, argparse._ActionsContainer] = {SERVER_ARG_GROUPS[0]: parser}
    fields_by_group: dict[str, list[tuple[dataclasses.Field, Any]]] = {title: [] for title in SERVER_ARG_GROUPS}
    for spec, type_hint in server_flag_fields():
        fields_by_group[spec.metadata["group"]].append((spec, type_hint))
    for title, specs in fields_by_group.items():
        if specs:
            container = containers.get(title) or parser.add_argument_group(title)
            for spec, type_hint in specs:
                add_field_flag(container, spec, type_hint)
    add_engine_args(parser, model_flag=False)


def server_flag_fields() -> list[tuple[dataclasses.Field, Any]]:
    """The fields that are serve flags, each with its type: ServerSettings' then DataParallelConfig's."""
    return declared_settings(ServerSettings) + declared_settings(DataParallelConfig)


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


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """ServerSettings from parsed flags."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("pagedllm serve: --enable-auto-tool-choice needs --tool-call-parser.")
    engine_args = engine_args_from_cli(args)
    data_parallel = DataParallelConfig(
        **{spec.name: getattr(args, spec.name) for spec, _ in declared_settings(DataParallelConfig)}
    )
    try:  # before the model loads: a missing Ray is named at once
        data_parallel.check()
    except DataParallelUnavailableError as exc:
        raise SystemExit(f"pagedllm serve: {exc}") from None
    return ServerSettings(
        engine_args=engine_args,
        data_parallel=data_parallel,
        **{spec.name: getattr(args, spec.name) for spec, _ in declared_settings(ServerSettings)},
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
