"""``llama3_json`` (Llama 3.1 / 3.2 JSON tool calling): the whole reply is one JSON object
``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``), or several joined by ``;``."""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_formats.base import ParsedToolCall, StreamView, ToolParser, tool_call_from_json
from pagedllm.entrypoints.openai.tool_formats.json_text import scan_call_object, skip_whitespace


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def _body_start(self, text: str) -> int | None:
        position = skip_whitespace(text, 0)
        if text.startswith(self.python_tag, position):
            position = skip_whitespace(text, position + len(self.python_tag))
        return position if text.startswith("{", position) else None

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        start = self._body_start(text)
        if start is None:
            return text, []
        body = text[start:].rstrip()
        decoder = json.JSONDecoder()
        calls, position = [], 0
        while position < len(body):
            try:
                value, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text, []
            call = tool_call_from_json(value, "parameters", call_id=self.new_call_id())
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

    def stream_view(self, text: str) -> StreamView:
        view = StreamView(self.content_end(text))
        position = self._body_start(text)
        while position is not None:
            call, end = scan_call_object(text, position, False, ("parameters", "arguments"))
            if call is not None:
                view.calls.append(call)
            if end is None:
                break
            position = skip_whitespace(text, end)
            if not text.startswith(";", position):
                break
            position = skip_whitespace(text, position + 1)
        return view
