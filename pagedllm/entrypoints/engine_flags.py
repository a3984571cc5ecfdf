"""Every engine setting as a command-line flag, made from EngineArgs' fields, shared by `generate`, `chat`
and `serve`.

A field's name becomes ``--kebab-case``; its type chooses the parsing (bool: ``--x`` / ``--no-x``; int, float,
str; Literal: its values as choices; list: one or more values); ``setting()``'s metadata adds the help, the
group, choices, aliases and byte sizes. The server's settings (ServerSettings, DataParallelConfig) are declared
the same way: `serve` makes their flags with ``declared_settings`` and ``add_field_flag``. Importing this module
stays cheap (no torch) so `pagedllm --help` is quick.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any

# pagedllm.config imports no torch (the package imports it first anyway), so --help stays quick.
from pagedllm.config import ENGINE_ARG_GROUPS, EngineArgs, parse_bytes

HUB_FIELDS = ("revision", "download_dir", "gguf_file")
_OTHER_GROUP = ENGINE_ARG_GROUPS[-1]


def flag_name(field_name: str) -> str:
    """The option string of an EngineArgs field: ``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + field_name.replace("_", "-")


def engine_arg_fields() -> dict[str, dataclasses.Field]:
    return {spec.name: spec for spec in dataclasses.fields(EngineArgs)}


def field_default(spec: dataclasses.Field) -> Any:
    if spec.default is not dataclasses.MISSING:
        return spec.default
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return None


def add_hub_args(group: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """How a hub id is fetched (also `pagedllm download`'s flags)."""
    specs = engine_arg_fields()
    for name in HUB_FIELDS:
        add_field_flag(group, specs[name])


def add_engine_args(parser: argparse.ArgumentParser, model_flag: bool = True) -> None:
    """One flag per EngineArgs field, in --help groups; the defaults are the fields' defaults.

    A flag the command already defines with the field's name as its dest (serve's ``--model``) is
    left to the command: its value still reaches the field through engine_args_from_cli.
    """
    by_group: dict[str, list[dataclasses.Field]] = {title: [] for title in ENGINE_ARG_GROUPS}
    for spec in dataclasses.fields(EngineArgs):
        if spec.name == "model" and not model_flag:
            continue
        existing = parser._option_string_actions.get(flag_name(spec.name))
        if existing is not None and existing.dest == spec.name:
            continue
        by_group[spec.metadata.get("group", _OTHER_GROUP)].append(spec)
    for title, specs in by_group.items():
        if specs:
            group = parser.add_argument_group(title)
            for spec in specs:
                add_field_flag(group, spec)


def add_field_flag(container: argparse._ActionsContainer, spec: dataclasses.Field, type_hint: Any = None) -> None:
    """The flag of one field (plus its aliases) on a parser or group; ``type_hint``: the field's type,
    by default its EngineArgs annotation."""
    meta = spec.metadata
    default = field_default(spec)
    value_type, _ = _unwrap_optional(_type_hints()[spec.name] if type_hint is None else type_hint)
    kwargs: dict[str, Any] = {"dest": spec.name, "default": default}
    if meta.get("byte_size"):
        kwargs.update(type=_byte_size, metavar="BYTES")
    elif value_type is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(value_type) is typing.Literal:
        values = list(typing.get_args(value_type))
        kwargs["choices"] = values
        if not isinstance(values[0], str):
            kwargs["type"] = type(values[0])
    elif typing.get_origin(value_type) in (list, tuple):
        item_types = [t for t in typing.get_args(value_type) if t is not Ellipsis]
        kwargs.update(nargs="+", type=item_types[0] if item_types and item_types[0] in (int, float) else str)
    elif value_type in (int, float):
        kwargs["type"] = _positive(value_type) if meta.get("positive") else value_type
    # Anything else (str, or a union such as speculative_config's JSON text) goes to the field as
    # text, and the field reads it.
    if meta.get("positive") and value_type not in (int, float):
        raise TypeError(f"setting {spec.name!r}: positive=True needs an int or float field, not {value_type!r}.")
    if meta.get("parse") is not None:
        kwargs["type"] = meta["parse"]
    choices = meta.get("choices")
    if choices is not None:
        kwargs["choices"] = list(choices() if callable(choices) else choices)
    if meta.get("metavar"):
        kwargs["metavar"] = meta["metavar"]
    kwargs["help"] = _help_text(spec, kwargs.get("action") is argparse.BooleanOptionalAction)
    container.add_argument(flag_name(spec.name), *meta.get("aliases", ()), **kwargs)
    for negative in meta.get("negative_aliases", ()):
        container.add_argument(
            negative, dest=spec.name, action="store_false", help=f"Same as --no-{flag_name(spec.name)[2:]}."
        )


def declared_settings(settings_class: type) -> list[tuple[dataclasses.Field, Any]]:
    """The fields of a settings dataclass declared with setting() (those that have a flag), each with its type."""
    hints = typing.get_type_hints(settings_class)
    return [(spec, hints[spec.name]) for spec in dataclasses.fields(settings_class) if "group" in spec.metadata]


def engine_args_from_cli(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from parsed flags (a positional MODEL, where the command has one, wins)."""
    values = {name: getattr(args, name) for name in engine_arg_fields() if hasattr(args, name)}
    model_tag = getattr(args, "model_tag", None)
    if model_tag:
        values["model"] = model_tag
    return EngineArgs(**values)


@functools.cache
def _type_hints() -> dict[str, Any]:
    try:
        return typing.get_type_hints(EngineArgs)
    except NameError:
        # A field annotated with a name config.py imports only for type checkers: that field's flag
        # takes text (the field reads it), every other field keeps its type.
        import pagedllm.config as config_module

        hints = {}
        for spec in dataclasses.fields(EngineArgs):
            try:
                hints[spec.name] = eval(spec.type, vars(config_module)) if isinstance(spec.type, str) else spec.type
            except NameError:
                hints[spec.name] = str
        return hints


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """(X, True) for ``X | None``; a union of several types other than None stays as it is."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [t for t in typing.get_args(hint) if t is not type(None)]
        if len(members) == 1:
            return members[0], True
    return hint, False


def _help_text(spec: dataclasses.Field, boolean: bool) -> str:
    text = spec.metadata.get("help")
    if text is None:
        text = f"EngineArgs.{spec.name} (pagedllm/config.py)."
    text = text.replace("%", "%%")  # argparse formats help with %
    # BooleanOptionalAction appends the default itself.
    if not boolean and "default" not in text:
        text += " (default: %(default)s)"
    return text


@functools.cache
def _positive(value_type: type) -> Callable[[str], int | float]:
    """A flag type that takes only an int >= 1, or a finite float > 0."""

    def parse_positive(text: str) -> int | float:
        value = value_type(text)  # a ValueError reads "invalid int value" / "invalid float value"
        if value_type is int and value < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
        if value_type is float and (not value > 0 or value == float("inf")):
            raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
        return value

    parse_positive.__name__ = value_type.__name__
    return parse_positive


def _byte_size(text: str) -> int | None:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
