"""``hermes`` (Hermes 2 Pro, Qwen2.5): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks;
the text before the first block is the message's content."""

from __future__ import annotations

import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_formats.base import (
    ParsedToolCall,
    StreamView,
    ToolParser,
    content_end_before,
    tool_call_from_json,
)
from pagedllm.entrypoints.openai.tool_formats.json_text import scan_call_object, skip_whitespace


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

    def _call(self, body: str) -> ParsedToolCall | None:
        try:
            return tool_call_from_json(json.loads(body.strip()), call_id=self.new_call_id())
        except json.JSONDecodeError:
            return None

    def structural_tag(self, schemas: dict[str, dict[str, Any]], single_call: bool) -> dict[str, Any] | None:
        # Once the model writes <tool_call>, the call is held to the layout Hermes and Qwen templates
        # use, the name to a tool's and the arguments to that tool's schema; outside calls, free text.
        tags = [
            {"begin": f'{self.start}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": schema}, "end": f"}}\n{self.end}"}
            for name, schema in schemas.items()
        ]
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [self.start],
                                                     "tags": tags, "stop_after_first": single_call}}

    def content_end(self, text: str) -> int:
        return content_end_before(text, (self.start,))

    def complete_calls(self, text: str) -> list[ParsedToolCall]:
        calls = []
        for match in re.finditer(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
            call = self._call(match.group(1))
            if call is not None:
                calls.append(call)
        return calls

    def stream_view(self, text: str) -> StreamView:
        view = StreamView(self.content_end(text))
        position = text.find(self.start)
        while position >= 0:
            body = skip_whitespace(text, position + len(self.start))
            call, _ = scan_call_object(text, body, False, ("arguments", "parameters"))
            if call is None:
                break
            view.calls.append(call)
            position = text.find(self.start, body)
        return view
