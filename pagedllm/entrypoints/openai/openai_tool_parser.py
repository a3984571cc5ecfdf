"""``--tool-call-parser openai``: GPT-OSS's tool calls, harmony messages to ``functions.NAME``.

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The text it reads is either the content the ``gpt_oss`` reasoning parser leaves (the final
channel's text with the calls kept as harmony text) or a whole harmony reply; either way the
content is the text of the messages that are neither analysis nor calls.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.harmony import (
    CHANNEL,
    START,
    HarmonyMessage,
    HarmonyParser,
    harmony_stop_token_ids,
    partial_marker_len,
)
from pagedllm.entrypoints.openai.tool_formats.base import ParsedToolCall, PartialToolCall, StreamView, ToolParser


def _call(message: HarmonyMessage) -> ParsedToolCall:
    # The arguments as the model wrote them (GPT-OSS writes compact JSON): a stream can then send
    # them piece by piece, each piece a prefix of the finished text.
    return ParsedToolCall(message.function_name or "", message.text.strip())


def _is_content(message: HarmonyMessage) -> bool:
    return message.channel != "analysis" and message.recipient is None


class OpenAIToolParser(ToolParser):
    name = "openai"
    needs_special_tokens = True

    def stop_token_ids(self, tokenizer: Any) -> list[int]:
        return harmony_stop_token_ids(tokenizer)  # a call ends at <|call|>, an answer at <|return|>

    def _messages(self, text: str, finished: bool) -> list[HarmonyMessage]:
        parser = HarmonyParser()
        parser.feed(text, finished)
        return parser.messages

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        messages = self._messages(text, True)
        calls = [_call(m) for m in messages if m.function_name is not None]
        if not calls:
            return text, []
        content = "".join(m.text for m in messages if _is_content(m)).strip()
        return content or None, calls

    def content_end(self, text: str) -> int:
        found = [index for index in (text.find(CHANNEL), text.find(START)) if index != -1]
        if found:
            return min(found)
        return len(text) - partial_marker_len(text)

    def complete_calls(self, text: str) -> list[ParsedToolCall]:
        return [_call(m) for m in self._messages(text, False) if m.function_name is not None and m.done]

    def stream_view(self, text: str) -> StreamView:
        calls = [
            PartialToolCall(m.function_name, m.text.strip())
            for m in self._messages(text, False)
            if m.function_name is not None
        ]
        return StreamView(self.content_end(text), calls)
