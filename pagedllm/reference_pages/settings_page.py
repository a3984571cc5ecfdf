"""reference/settings.md: every engine and server setting, from the settings dataclasses and the flags
the CLI builds from them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pagedllm.config import ENGINE_ARG_GROUPS, SERVER_ARG_GROUPS, EngineArgs
from pagedllm.entrypoints.engine_flags import field_default
from pagedllm.entrypoints.openai.settings import ServerSettings
from pagedllm.reference_pages.cli_flags import FlagTable, commands_by_dest, engine_flags, serve_flags
from pagedllm.reference_pages.markdown import cell, code, page, table
from pagedllm.serving.data_parallel import DataParallelConfig

_HEADER = ("setting", "flag", "type", "default", "help")
_BINARY_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def render(
    engine_class: type = EngineArgs,
    server_classes: Sequence[type] = (ServerSettings, DataParallelConfig),
) -> str:
    """The page. The classes are arguments so that a test can render a changed copy; the flags always
    come from the CLI's parsers, which read the real classes (a test changes those by monkeypatching)."""
    engine, serve = engine_flags(), serve_flags()
    commands = commands_by_dest()
    engine_names = {spec.name for spec in dataclasses.fields(engine_class)}
    body: list[str] = [
        "Engine settings are keyword arguments of `LLM(...)` (and fields of `EngineArgs`) and flags of the "
        "commands named in each section; server settings are flags of `pagedllm serve` only. A flag's value "
        "sets the field of the same name.",
        "",
    ]
    engine_groups = _by_group(dataclasses.fields(engine_class), ENGINE_ARG_GROUPS, default=ENGINE_ARG_GROUPS[-1])
    for group, specs in engine_groups.items():
        takers = [*_commands(specs, commands), "`LLM(...)`"]
        body += _section(group, f"Engine settings (`{engine_class.__name__}`), taken by {_and(takers)}.",
                         [_row(spec, engine, None) for spec in specs])
    no_flag: list[tuple[type, dataclasses.Field]] = []
    server_specs: list[dataclasses.Field] = []
    owners: dict[str, type] = {}
    for settings_class in server_classes:
        for spec in dataclasses.fields(settings_class):
            if "group" in spec.metadata:
                server_specs.append(spec)
                owners[spec.name] = settings_class
            else:
                no_flag.append((settings_class, spec))
    for group, specs in _by_group(server_specs, SERVER_ARG_GROUPS, default=None).items():
        intro = (f"Server settings ({', '.join(sorted({f'`{owners[s.name].__name__}`' for s in specs}))}), "
                 f"taken by {_and(_commands(specs, commands))} only.")
        body += _section(group, intro, [_row(spec, serve, "EngineArgs" if spec.name in engine_names else None)
                                        for spec in specs])
    if no_flag:
        flagged = {cls.__name__ for cls in (engine_class, *server_classes)}
        rows = [[code(f"{owner.__name__}.{spec.name}"), "(none)", code(_type(spec)), _default(spec),
                 cell(f"Set by the flags of {_type(spec)}'s settings above." if _type(spec) in flagged
                      else "No flag: set in code.")] for owner, spec in no_flag]
        body += _section("set in code only", "Fields of the server's settings that no flag sets.", rows)
    return page(
        "Settings",
        "Generated from the dataclasses `EngineArgs` (pagedllm/config.py), `ServerSettings` "
        "(pagedllm/entrypoints/openai/settings.py) and `DataParallelConfig` (pagedllm/serving/data_parallel.py), "
        "with each flag as the command line's parsers build it.",
        body,
    )


def _by_group(specs: Sequence[dataclasses.Field], groups: Sequence[str],
              default: str | None) -> dict[str, list[dataclasses.Field]]:
    """Fields by their setting() group, in the groups' --help order; a plain field goes to ``default``."""
    found: dict[str, list[dataclasses.Field]] = {group: [] for group in groups}
    for spec in specs:
        found[spec.metadata.get("group", default)].append(spec)
    return {group: specs for group, specs in found.items() if specs}


def _commands(specs: Sequence[dataclasses.Field], commands: dict[str, list[str]]) -> list[str]:
    """The subcommands that have a flag for every one of ``specs``."""
    common: set[str] | None = None
    for spec in specs:
        common = set(commands.get(spec.name, ())) if common is None else common & set(commands.get(spec.name, ()))
    order = {command: i for i, command in enumerate(commands.get(specs[0].name, ()))}
    return [f"`{command}`" for command in sorted(common or (), key=order.__getitem__)]


def _and(items: Sequence[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)


def _section(title: str, intro: str, rows: list[list[str]]) -> list[str]:
    return [f"## {title[0].upper()}{title[1:]}", "", intro, "", *table(_HEADER, rows), ""]


def _row(spec: dataclasses.Field, flags: FlagTable, also_sets: str | None) -> list[str]:
    options = flags.options.get(spec.name)
    flag = ", ".join(code(option) for option in options) if options else "(none)"
    # setting()'s help is the flag's; a plain field's flag has a generic help, read off the parser.
    parts = [cell(spec.metadata.get("help") or flags.help.get(spec.name, ""))]
    choices = flags.choices.get(spec.name)
    if choices:
        parts.append("Choices: " + ", ".join(code(choice) for choice in choices) + ".")
    if also_sets:
        parts.append(cell(f"Also sets {also_sets}.{spec.name}."))
    return [code(spec.name), flag, code(_type(spec)), _default(spec), " ".join(parts)]


def _type(spec: dataclasses.Field) -> str:
    # Annotations are strings under ``from __future__ import annotations``: the source's own spelling.
    return spec.type if isinstance(spec.type, str) else getattr(spec.type, "__name__", str(spec.type))


def _default(spec: dataclasses.Field) -> str:
    if spec.default is dataclasses.MISSING and spec.default_factory is not dataclasses.MISSING:
        return code(f"{getattr(spec.default_factory, '__name__', 'factory')}()")
    value: Any = field_default(spec)
    text = code(repr(value))
    if spec.metadata.get("byte_size") and isinstance(value, int) and value:
        for unit, size in _BINARY_UNITS:
            if value % size == 0:
                return f"{text} ({value // size} {unit})"
    return text
