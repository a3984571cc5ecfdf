"""``deepseek_v3`` (DeepSeek-V3 / V3-0324 / R1): calls between full-width markers, arguments in a JSON fence.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(``｜`` is U+FF5C, ``▁`` is U+2581.) The arguments are passed on as the model wrote them, as vLLM's
``deepseek_v3`` does; the text before the calls is the content.
"""

from __future__ import annotations

import re

from pagedllm.entrypoints.openai.tool_formats.base import (
    ParsedToolCall,
    PartialToolCall,
    StreamView,
    ToolParser,
    content_end_before,
    partial_prefix_len,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEPARATOR = "<｜tool▁sep｜>"
FENCE_OPEN = "\n```json\n"
FENCE_CLOSE = "\n```"

_CALL = re.compile(
    re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(SEPARATOR) + r"(.*?)\n```json\n(.*?)\n```" + re.escape(CALL_END),
    re.DOTALL,
)


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    markers = (CALLS_BEGIN, CALL_BEGIN)

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        start = self.content_end(text)
        if start == len(text) or not text.startswith(self.markers, start):
            return text, []
        calls = [ParsedToolCall(name, arguments, self.new_call_id()) for _, name, arguments in _CALL.findall(text)]
        if not calls:
            return text, []
        content = text[:start]
        return content or None, calls

    def content_end(self, text: str) -> int:
        return content_end_before(text, self.markers)

    def stream_view(self, text: str) -> StreamView:
        view = StreamView(self.content_end(text))
        position = text.find(CALL_BEGIN, view.content_end)
        while position >= 0:
            separator = text.find(SEPARATOR, position)
            if separator < 0:
                break
            name_start = separator + len(SEPARATOR)
            name_end = text.find("\n", name_start)
            if name_end < 0:
                break  # the name is complete at its line's end
            call = PartialToolCall(text[name_start:name_end])
            view.calls.append(call)
            if not text.startswith(FENCE_OPEN, name_end):
                break
            arguments_start = name_end + len(FENCE_OPEN)
            arguments_end = text.find(FENCE_CLOSE + CALL_END, arguments_start)
            if arguments_end < 0:
                # Hold back a tail that may be the closing fence's start.
                tail = text[arguments_start:]
                call.arguments = tail[: len(tail) - partial_prefix_len(tail, FENCE_CLOSE + CALL_END)]
                break
            call.arguments = text[arguments_start:arguments_end]
            position = text.find(CALL_BEGIN, arguments_end)
        return view
