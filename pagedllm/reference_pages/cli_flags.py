"""The command-line flags of each setting, read off parsers built by the CLI's own code.

The flags are never spelt here: ``add_engine_args`` (generate, chat, env) and ``add_server_args``
(serve) build fresh parsers, and each field's option strings are those of the actions whose dest is
the field's name, aliases and ``--no-...`` negatives included.
"""

from __future__ import annotations

import argparse
import re

from pagedllm.entrypoints.engine_flags import add_engine_args
from pagedllm.entrypoints.serve_cli import add_server_args

# What engine_flags._help_text (and BooleanOptionalAction) append; the page has a default column.
_DEFAULT_SUFFIX = re.compile(r"\s*\(default: %\(default\)s\)$")


class FlagTable:
    """The option strings and help of every dest of one parser."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.options: dict[str, list[str]] = {}
        self.help: dict[str, str] = {}
        self.choices: dict[str, list[object]] = {}
        for action in parser._actions:
            if not action.option_strings:  # a positional (serve's MODEL) or --help's own
                continue
            self.options.setdefault(action.dest, []).extend(action.option_strings)
            if action.dest not in self.help and action.help is not None:
                # The first action of a dest is the field's flag; later ones are its negative aliases.
                self.help[action.dest] = _DEFAULT_SUFFIX.sub("", action.help).replace("%%", "%")
                if action.choices is not None:
                    self.choices[action.dest] = list(action.choices)


def engine_flags() -> FlagTable:
    """The flags `generate` and `chat` get for EngineArgs' fields."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    return FlagTable(parser)


def serve_flags() -> FlagTable:
    """The flags of `pagedllm serve`: ServerSettings', DataParallelConfig's, then the engine's."""
    parser = argparse.ArgumentParser(add_help=False)
    add_server_args(parser)
    return FlagTable(parser)


def commands_by_dest() -> dict[str, list[str]]:
    """dest -> the `pagedllm` subcommands that have a flag for it, from the real CLI parser."""
    from pagedllm.entrypoints.cli import build_parser

    found: dict[str, list[str]] = {}
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, subparser in action.choices.items():
                for dest in FlagTable(subparser).options:
                    found.setdefault(dest, []).append(command)
    return found
