"""Tool calls read out of generated text (``--tool-call-parser``, vLLM's names).

- ``hermes`` (Hermes 2 Pro, Qwen2.5): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks; the text before the first block is the message's content.
- ``llama3_json`` (Llama 3.1 / 3.2 JSON tool calling): the whole reply is one JSON object
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``), or several joined
  by ``;``.

A parser also tells a stream how much of a partial reply is surely content (it can be sent) and
which tool calls are complete so far.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def tool_call_from_json(value: Any, arguments_key: str = "arguments") -> ParsedToolCall | None:
    """{"name": str, "arguments" | "parameters": object} -> a call; anything else -> None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("parameters", value.get("arguments", {})))
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_prefix_len(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class ToolParser:
    name = ""

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(the content, the tool calls) of a finished reply; no calls: the whole text is content."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """How many leading characters of a partial reply are content for sure."""
        raise NotImplementedError

    def complete_calls(self, text: str) -> list[ParsedToolCall]:
        """The tool calls a partial reply holds in full so far (a stream sends each once)."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)$", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        if self.start not in text:
            return text, []
        calls = []
        for match in self._block.finditer(text):
            call = self._call(match.group(1) if match.group(1) is not None else match.group(2))
            if call is None:
                return text, []  # not the format after all: leave the reply as it is
            calls.append(call)
        content = text[: text.index(self.start)].strip()
        return content or None, calls

    @staticmethod
    def _call(body: str) -> ParsedToolCall | None:
        try:
            return tool_call_from_json(json.loads(body.strip()))
        except json.JSONDecodeError:
            return None

    def content_end(self, text: str) -> int:
        index = text.find(self.start)
        if index >= 0:
            return index
        return len(text) - _partial_prefix_len(text, self.start)

    def complete_calls(self, text: str) -> list[ParsedToolCall]:
        calls = []
        for match in re.finditer(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
            call = self._call(match.group(1))
            if call is not None:
                calls.append(call)
        return calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def _body(self, text: str) -> str | None:
        stripped = text.strip()
        if stripped.startswith(self.python_tag):
            stripped = stripped[len(self.python_tag) :].strip()
        return stripped if stripped.startswith("{") else None

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        body = self._body(text)
        if body is None:
            return text, []
        decoder = json.JSONDecoder()
        calls, position = [], 0
        while position < len(body):
            try:
                value, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text, []
            call = tool_call_from_json(value, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            rest = body[position:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            position = len(body) - len(rest)
        return None, calls

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or self.python_tag.startswith(stripped[: len(self.python_tag)]) or stripped[0] == "{":
            return 0  # may be (or is) a tool call: nothing is content until the reply ends
        return len(text)

    def complete_calls(self, text: str) -> list[ParsedToolCall]:
        return []  # one JSON document: complete only when the reply is


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}
