"""What every tool-call parser provides: a finished reply's calls, and a partial reply's view for streaming.

A stream asks the parser, after each new piece of text, for a ``StreamView`` of everything so far:
how much of it is content for sure, and each call begun so far with its name and the arguments text
known so far. The view is recomputed from the whole text each time (replies are short), so parsers
keep no per-request state; the stream sends what is new (``chat_tools.ToolCallStream``).
"""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def random_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=random_tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class PartialToolCall:
    """A call a partial reply has begun: its name is complete; ``arguments`` is a prefix of the final text."""

    name: str
    arguments: str = ""


@dataclass
class StreamView:
    content_end: int  # leading characters that are content for sure
    calls: list[PartialToolCall] = field(default_factory=list)


def tool_call_from_json(
    value: Any, arguments_key: str = "arguments", call_id: str | None = None
) -> ParsedToolCall | None:
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
    call = ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
    if call_id is not None:
        call.id = call_id
    return call


def partial_prefix_len(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def content_end_before(text: str, markers: tuple[str, ...]) -> int:
    """Content ends at the first marker; without one, a tail that may be a marker's start is held back."""
    found = [index for index in (text.find(marker) for marker in markers) if index >= 0]
    if found:
        return min(found)
    return len(text) - max(partial_prefix_len(text, marker) for marker in markers)


class ToolParser:
    """One model family's tool-call format (``--tool-call-parser NAME``).

    A subclass implements ``parse`` and ``content_end``; for streamed calls either ``stream_view``
    (calls open with their name, then their arguments stream) or ``complete_calls`` (each call is
    sent whole once complete).
    """

    name = ""
    # The format's markers are special tokens: the reply must be detokenized with them.
    needs_special_tokens = False

    def __init__(self) -> None:
        self.tools: list[dict[str, Any]] = []  # the request's tools, for formats typed by their schemas

    def stop_token_ids(self, tokenizer: Any) -> list[int]:
        """Tokens that end a reply in this format besides the tokenizer's EOS (none for most)."""
        return []

    def for_request(self, tools: list[dict[str, Any]] | None) -> ToolParser:
        """A copy that knows the request's tools (the server's parser is shared by all requests)."""
        clone = copy.copy(self)
        clone.tools = list(tools or [])
        return clone

    def new_call_id(self) -> str:
        return random_tool_call_id()

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(the content, the tool calls) of a finished reply; no calls: the whole text is content."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """How many leading characters of a partial reply are content for sure."""
        raise NotImplementedError

    def complete_calls(self, text: str) -> list[ParsedToolCall]:
        """The tool calls a partial reply holds in full so far."""
        return []

    def stream_view(self, text: str) -> StreamView:
        """A partial reply's content end and the calls begun so far."""
        calls = [PartialToolCall(call.name, call.arguments) for call in self.complete_calls(text)]
        return StreamView(self.content_end(text), calls)

    def structural_tag(self, schemas: dict[str, dict[str, Any]], single_call: bool) -> dict[str, Any] | None:
        """An xgrammar structural tag (JSON-able) that leaves the reply free but makes every tool call in
        this format follow its tool's schema (``schemas``: name -> parameters), at most one call when
        ``single_call``; None where the format has no trigger that opens a call (strict tools are then
        refused under tool_choice "auto")."""
        return None

    def tool_schema(self, name: str) -> dict[str, Any]:
        """The JSON schema of the named tool's parameters ({} when the request has no such tool)."""
        for tool in self.tools:
            function = tool.get("function", tool)
            if function.get("name") == name:
                parameters = function.get("parameters")
                return parameters if isinstance(parameters, dict) else {}
        return {}
