"""``mistral`` (Mistral 7B Instruct v0.3, Mistral Small / Nemo, Devstral, Magistral).

Two spellings after the ``[TOOL_CALLS]`` token:
- a JSON array (tokenizers before v11): ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``;
- one call per token (v11 and later): ``[TOOL_CALLS]f{...}`` or ``[TOOL_CALLS]f[ARGS]{...}``.
Text before the first ``[TOOL_CALLS]`` is the content. Call ids are 9 letters and digits, the only
ids Mistral's chat templates accept back.
"""

from __future__ import annotations

import json
import random
import re
import string

from pagedllm.entrypoints.openai.tool_formats.base import (
    ParsedToolCall,
    PartialToolCall,
    StreamView,
    ToolParser,
    content_end_before,
    tool_call_from_json,
)
from pagedllm.entrypoints.openai.tool_formats.json_text import (
    scan_call_array,
    scan_json_value,
    skip_whitespace,
    spelled,
)

_ID_ALPHABET = string.ascii_letters + string.digits
_NAME = re.compile(r"([A-Za-z0-9_.\-]+)\s*(?:\[ARGS\]|(?=\{))")


def mistral_tool_call_id() -> str:
    return "".join(random.choices(_ID_ALPHABET, k=9))


class MistralToolParser(ToolParser):
    name = "mistral"
    bot = "[TOOL_CALLS]"
    # [TOOL_CALLS] is a special token of Mistral's tokenizers: skipping special tokens would erase it.
    needs_special_tokens = True

    def new_call_id(self) -> str:
        return mistral_tool_call_id()

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        start = text.find(self.bot)
        if start < 0:
            return text, []
        after = start + len(self.bot)
        if text.startswith("[", skip_whitespace(text, after)):
            calls = self._array_calls(text[after:])
        else:
            calls = self._named_calls(text, after)
        if not calls:
            return text, []
        content = text[:start]
        return content or None, calls

    def _array_calls(self, body: str) -> list[ParsedToolCall] | None:
        tool_content = body.replace(self.bot, "").strip()
        try:
            items = json.loads(tool_content)
        except json.JSONDecodeError:
            # A model that goes on after the array: the outermost [{...}] is the calls.
            match = re.search(r"\[\{.*\}\]", tool_content, re.DOTALL)
            if match is None:
                return None
            try:
                items = json.loads(match.group())
            except json.JSONDecodeError:
                return None
        if not isinstance(items, list):
            return None
        calls = [tool_call_from_json(item, "arguments", call_id=self.new_call_id()) for item in items]
        return None if any(call is None for call in calls) else calls

    def _named_calls(self, text: str, position: int) -> list[ParsedToolCall] | None:
        partials, end = self._scan_named(text, position, finished=True)
        if end is None or text[end:].strip():
            return None
        calls = []
        for partial in partials:
            try:
                arguments = json.loads(partial.arguments)
            except json.JSONDecodeError:
                return None
            if not isinstance(arguments, dict):
                return None
            calls.append(ParsedToolCall(partial.name, json.dumps(arguments, ensure_ascii=False), self.new_call_id()))
        return calls

    def _scan_named(self, text: str, position: int, finished: bool) -> tuple[list[PartialToolCall], int | None]:
        """The ``NAME{...}`` calls from ``position``: (the calls begun, where the last closed call ends)."""
        calls: list[PartialToolCall] = []
        end: int | None = None
        while True:
            position = skip_whitespace(text, position)
            if text.startswith(self.bot, position):
                position += len(self.bot)
                continue
            if calls and text.startswith(",", position):
                position += 1
                continue
            match = _NAME.match(text, position)
            if match is None:
                return calls, end
            tokens, closed = scan_json_value(text, match.end(), finished)
            if tokens and tokens[0].kind != "{":
                return calls, None
            calls.append(PartialToolCall(match.group(1), spelled(tokens)))
            if not closed:
                return calls, None
            position = end = tokens[-1].end

    def content_end(self, text: str) -> int:
        return content_end_before(text, (self.bot,))

    def stream_view(self, text: str) -> StreamView:
        view = StreamView(self.content_end(text))
        start = text.find(self.bot)
        if start < 0:
            return view
        after = start + len(self.bot)
        if text.startswith("[", skip_whitespace(text, after)):
            view.calls = scan_call_array(text, after, False, ("arguments",))
        else:
            view.calls, _ = self._scan_named(text, after, finished=False)
        return view
