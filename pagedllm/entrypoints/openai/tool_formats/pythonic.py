"""``pythonic`` (Llama 3.2 / Llama 4, ToolACE, ...): the reply is a Python list of calls with keyword
arguments, ``[get_weather(city="Paris"), get_time(zone="CET")]``, optionally between Llama 4's
``<|python_start|>`` and ``<|python_end|>``.

It is read with ``ast`` and literals only (strings, numbers, booleans, None, lists, dicts; tuples
become lists): nothing is evaluated. A reply that is not such a list is content. Streamed, a call
opens once ``NAME(`` is written and its arguments grow one complete keyword argument at a time.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_formats.base import ParsedToolCall, PartialToolCall, StreamView, ToolParser

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_CALL_NAME = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


class _NotLiteral(ValueError):
    pass


def _literal(node: ast.expr) -> Any:
    """A literal's value, JSON-able (tuples as lists); anything else (a name, a call, ...) raises."""
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError) as exc:  # a name or a call; an unhashable dict key
        raise _NotLiteral(str(exc)) from exc
    return _jsonable(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_jsonable(item) for item in value]
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise _NotLiteral("dict keys must be strings")
        return {key: _jsonable(item) for key, item in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise _NotLiteral(f"{type(value).__name__} is not JSON")


def _call_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_call_name(node.value)}.{node.attr}"
    raise _NotLiteral("a call's function must be a name")


def _arguments_json(keywords: dict[str, Any]) -> str:
    return json.dumps(keywords, ensure_ascii=False)


class PythonicToolParser(ToolParser):
    name = "pythonic"

    @staticmethod
    def _body(text: str) -> str:
        body = text.strip()
        if body.startswith(PYTHON_START):
            body = body[len(PYTHON_START) :]
        if body.endswith(PYTHON_END):
            body = body[: -len(PYTHON_END)]
        return body.strip()

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        body = self._body(text)
        if not (body.startswith("[") and body.endswith("]")):
            return text, []
        try:
            tree = ast.parse(body, mode="eval")
            if not isinstance(tree.body, ast.List) or not tree.body.elts:
                return text, []
            calls = []
            for element in tree.body.elts:
                if not isinstance(element, ast.Call) or element.args:
                    return text, []
                keywords = {}
                for keyword in element.keywords:
                    if keyword.arg is None:  # **kwargs
                        return text, []
                    keywords[keyword.arg] = _literal(keyword.value)
                calls.append(ParsedToolCall(_call_name(element.func), _arguments_json(keywords), self.new_call_id()))
        except (SyntaxError, _NotLiteral, RecursionError, MemoryError):
            return text, []
        return None, calls

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_START):
            stripped = stripped[len(PYTHON_START) :].lstrip()
        elif PYTHON_START.startswith(stripped):
            return 0  # may be the tag's start
        # A reply that is (or may be) a list of calls: nothing is content until it ends.
        return 0 if not stripped or stripped.startswith("[") else len(text)

    def stream_view(self, text: str) -> StreamView:
        view = StreamView(self.content_end(text))
        if view.content_end:
            return view
        position = len(text) - len(text.lstrip())
        if text.startswith(PYTHON_START, position):
            position += len(PYTHON_START)
        position = len(text) - len(text[position:].lstrip())
        if not text.startswith("[", position):
            return view
        position += 1
        while True:
            match = _CALL_NAME.match(text, position)
            if match is None:
                return view
            call = PartialToolCall(match.group(1), "{")
            view.calls.append(call)
            pieces, end = self._keyword_arguments(text, match.end())
            call.arguments = "{" + ", ".join(pieces) + ("}" if end is not None else "")
            if end is None:
                return view
            position = len(text) - len(text[end:].lstrip())
            if not text.startswith(",", position):
                return view
            position += 1

    @staticmethod
    def _keyword_arguments(text: str, position: int) -> tuple[list[str], int | None]:
        """The complete ``key=value`` arguments of a call from just after its "(": (their JSON pieces,
        where the call's ")" ends or None while it is open)."""
        pieces: list[str] = []
        start = position
        stack: list[str] = []
        quote: str | None = None
        index = position
        while index < len(text):
            char = text[index]
            if quote is not None:
                if char == "\\":
                    index += 2
                    continue
                if text.startswith(quote, index):
                    index += len(quote)
                    quote = None
                    continue
                index += 1
                continue
            if char in "'\"":
                quote = char * 3 if text.startswith(char * 3, index) else char
                index += len(quote)
                continue
            if char in _CLOSERS:
                stack.append(_CLOSERS[char])
            elif stack and char == stack[-1]:
                stack.pop()
            elif not stack and char in ",)":
                segment = text[start:index].strip()
                if segment:
                    piece = _keyword_piece(segment)
                    if piece is None:
                        return pieces, None
                    pieces.append(piece)
                if char == ")":
                    return pieces, index + 1
                start = index + 1
            index += 1
        return pieces, None


def _keyword_piece(segment: str) -> str | None:
    """``key=value`` -> ``"key": <value as JSON>``; None when it is not a keyword with a literal."""
    try:
        call = ast.parse(f"f({segment})", mode="eval").body
        if not isinstance(call, ast.Call) or call.args or len(call.keywords) != 1 or call.keywords[0].arg is None:
            return None
        keyword = call.keywords[0]
        value = _literal(keyword.value)
    except (SyntaxError, _NotLiteral, RecursionError, MemoryError):
        return None
    return f"{json.dumps(keyword.arg, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
