"""JSON written by a model, read while it is still being written.

The complete tokens of a value are re-spelled as ``json.dumps(value, ensure_ascii=False)`` spells
them (``", "`` and ``": "`` between items, strings and numbers re-encoded), so the arguments text a
stream sends piece by piece is a prefix of the arguments of the finished reply, which the parsers
write with ``json.dumps``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pagedllm.entrypoints.openai.tool_formats.base import PartialToolCall

_WHITESPACE = " \t\n\r"
_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = ("true", "false", "null")


@dataclass(slots=True)
class JsonToken:
    kind: str  # "{", "}", "[", "]", ":", ",", "string", "number" or "literal"
    text: str  # as json.dumps writes it
    end: int  # where it ends in the model's text


def skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in _WHITESPACE:
        position += 1
    return position


def scan_json_value(text: str, position: int, finished: bool = False) -> tuple[list[JsonToken], bool]:
    """The complete tokens of the one JSON value at ``position``, and whether the value is closed.

    Scanning stops at the end of the text, at an unfinished token (a number at the very end may go
    on unless the reply is ``finished``) or at anything that is not JSON.
    """
    tokens: list[JsonToken] = []
    depth = 0
    while True:
        position = skip_whitespace(text, position)
        if position >= len(text):
            return tokens, False
        char = text[position]
        end = position + 1
        if char in "{[":
            kind, spelled, depth = char, char, depth + 1
        elif char in "}]":
            if depth == 0:
                return tokens, False
            kind, spelled, depth = char, char, depth - 1
        elif char in ":,":
            if depth == 0:
                return tokens, False
            kind, spelled = char, char + " "
        elif char == '"':
            match = _STRING.match(text, position)
            if match is None:
                return tokens, False
            kind, spelled, end = "string", json.dumps(json.loads(match.group()), ensure_ascii=False), match.end()
        elif char == "-" or char.isdigit():
            match = _NUMBER.match(text, position)
            if match is None or (match.end() == len(text) and not finished):
                return tokens, False
            kind, spelled, end = "number", json.dumps(json.loads(match.group())), match.end()
        else:
            literal = next((word for word in _LITERALS if text.startswith(word, position)), None)
            if literal is None:
                return tokens, False
            kind, spelled, end = "literal", literal, position + len(literal)
        tokens.append(JsonToken(kind, spelled, end))
        position = end
        if depth == 0:
            return tokens, True


def value_end(tokens: list[JsonToken], start: int) -> int | None:
    """Index just past the value whose first token is ``tokens[start]``; None while it is unfinished."""
    if start >= len(tokens):
        return None
    if tokens[start].kind not in ("{", "["):
        return start + 1
    depth = 0
    for index in range(start, len(tokens)):
        kind = tokens[index].kind
        if kind in ("{", "["):
            depth += 1
        elif kind in ("}", "]"):
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def spelled(tokens: list[JsonToken]) -> str:
    return "".join(token.text for token in tokens)


def scan_call_object(
    text: str, position: int, finished: bool, arguments_keys: tuple[str, ...]
) -> tuple[PartialToolCall | None, int | None]:
    """``{"name": ..., "<arguments key>": {...}}`` at ``position``: (the call once its name is known,
    where the object ends once it is closed)."""
    tokens, closed = scan_json_value(text, position, finished)
    if not tokens or tokens[0].kind != "{":
        return None, None
    name: str | None = None
    arguments: str | None = None
    index = 1
    while index < len(tokens) and tokens[index].kind != "}":
        if tokens[index].kind == ",":
            index += 1
            continue
        if tokens[index].kind != "string" or index + 1 >= len(tokens) or tokens[index + 1].kind != ":":
            break
        key = json.loads(tokens[index].text)
        end = value_end(tokens, index + 2)
        value = tokens[index + 2 : end if end is not None else len(tokens)]
        if key == "name" and end is not None and value[0].kind == "string":
            name = json.loads(value[0].text)
        elif key in arguments_keys and arguments is None and value:
            if value[0].kind == "{":
                arguments = spelled(value)
            elif end is not None and value[0].kind == "string":
                arguments = _arguments_from_json_text(json.loads(value[0].text))
        if end is None:
            break
        index = end
    call = PartialToolCall(name, arguments or "") if name is not None else None
    return call, (tokens[-1].end if closed else None)


def _arguments_from_json_text(text: str) -> str | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def scan_call_array(text: str, position: int, finished: bool, arguments_keys: tuple[str, ...]) -> list[PartialToolCall]:
    """The calls begun so far in ``[{call}, {call}, ...]`` at ``position``."""
    position = skip_whitespace(text, position)
    if not text.startswith("[", position):
        return []
    position += 1
    calls: list[PartialToolCall] = []
    while True:
        call, end = scan_call_object(text, skip_whitespace(text, position), finished, arguments_keys)
        if call is not None:
            calls.append(call)
        if end is None:
            return calls
        position = skip_whitespace(text, end)
        if not text.startswith(",", position):
            return calls
        position += 1
