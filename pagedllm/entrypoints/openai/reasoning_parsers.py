"""Reasoning read out of generated text (``--reasoning-parser``, vLLM's names).

- ``qwen3``: ``<think>...</think>``. Qwen3's templates may open ``<think>`` in the prompt (then the
  reply starts inside the reasoning); otherwise the reply is reasoning only when it opens
  ``<think>`` itself. ``enable_thinking=False`` (chat_template_kwargs): no reasoning at all.
- ``deepseek_r1``: the same tags, but DeepSeek-R1's template opens ``<think>`` in the prompt, so
  everything up to ``</think>`` is reasoning, and a reply that never closes it is all reasoning.
- ``gpt_oss``: the harmony format (harmony.py): the analysis channel is the reasoning, the final
  channel (and commentary preambles) the content; function calls stay in the content as harmony
  text (``<|channel|>commentary to=functions.NAME ...<|message|>{...}<|call|>``) for the
  ``openai`` tool parser to read.

A parser is built per request (``ReasoningParser(tokenizer, chat_template_kwargs=..., prompt=...)``);
``extract`` splits a finished reply, ``stream().delta`` a streamed one, holding back only what may
be the start of a marker, so a stream's deltas add up to what ``extract`` returns (for qwen3, when
the parser knows the prompt, as the chat server's do).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from pagedllm.entrypoints.openai.harmony import (
    CALL,
    CHANNEL,
    MESSAGE,
    HarmonyMessage,
    HarmonyParser,
    harmony_stop_token_ids,
)
from pagedllm.entrypoints.openai.tool_formats.base import partial_prefix_len


class ReasoningStream:
    """One streamed choice: the new text split into (reasoning delta, content delta)."""

    def delta(self, new_text: str, finished: bool) -> tuple[str, str]:
        raise NotImplementedError


class ReasoningParser:
    name: ClassVar[str] = ""
    # The parser reads special tokens (harmony's markers): the reply must keep them in its text.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(
        self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None, prompt: str | None = None
    ) -> None:
        """``chat_template_kwargs`` and ``prompt`` (the rendered prompt text) describe the request, when known."""
        self.tokenizer = tokenizer
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.prompt = prompt

    @property
    def thinking_enabled(self) -> bool:
        return self.chat_template_kwargs.get("enable_thinking") is not False

    def stop_token_ids(self) -> list[int]:
        """Tokens that end a reply in this model's format besides the tokenizer's EOS (none for most)."""
        return []

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished reply; an empty part is None."""
        reasoning, content = self.stream().delta(text, True)
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        raise NotImplementedError

    def reasoning_end_token_ids(self) -> list[int] | None:
        """The token ids whose generation ends the reasoning (structured outputs start after them);
        None: this request has no reasoning, a constraint applies from the first token."""
        raise NotImplementedError

    def reasoning_open_token_ids(self) -> list[int] | None:
        """Where a reply may answer without reasoning: the token ids that open its reasoning (a constraint
        then applies from the first token unless the reply opens with them). None: the reply reasons
        from its first token, or not at all."""
        return None

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


class ThinkTagStream(ReasoningStream):
    """``<think>reasoning</think>content``: reasoning opens with the tag, or at once (``starts_in_reasoning``)."""

    def __init__(self, start_tag: str, end_tag: str, starts_in_reasoning: bool, thinking: bool = True) -> None:
        self.start_tag, self.end_tag = start_tag, end_tag
        self.starts_in_reasoning = starts_in_reasoning
        self.state = "start" if thinking else "content"
        self.pending = ""

    def delta(self, new_text: str, finished: bool) -> tuple[str, str]:
        self.pending += new_text
        reasoning, content = "", ""
        while self.pending:
            if self.state == "start":
                stripped = self.pending.lstrip()
                if stripped.startswith(self.start_tag):  # the model opened it (or repeated the prompt's)
                    self.state, self.pending = "reasoning", stripped[len(self.start_tag) :]
                    continue
                if not finished and (not stripped or self.start_tag.startswith(stripped)):
                    break  # only whitespace, or a partial tag so far
                self.state = "reasoning" if self.starts_in_reasoning else "content"
            elif self.state == "reasoning":
                index = self.pending.find(self.end_tag)
                if index != -1:
                    reasoning += self.pending[:index]
                    self.pending = self.pending[index + len(self.end_tag) :]
                    self.state = "content"
                    continue
                keep = 0 if finished else partial_prefix_len(self.pending, self.end_tag)
                reasoning += self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep :]
                break
            else:
                content += self.pending
                self.pending = ""
        return reasoning, content


class ThinkTagReasoningParser(ReasoningParser):
    start_tag, end_tag = "<think>", "</think>"

    def prompt_opens_reasoning(self) -> bool | None:
        """Whether the prompt leaves a ``<think>`` open (the reply starts inside it); None: prompt unknown."""
        if self.prompt is None:
            return None
        return self.prompt.rfind(self.start_tag) > self.prompt.rfind(self.end_tag)

    def starts_in_reasoning(self, text: str | None) -> bool:
        raise NotImplementedError

    def stream(self) -> ThinkTagStream:
        return ThinkTagStream(self.start_tag, self.end_tag, self.starts_in_reasoning(None), self.thinking_enabled)

    def extract(self, text: str) -> tuple[str | None, str | None]:
        stream = ThinkTagStream(self.start_tag, self.end_tag, self.starts_in_reasoning(text), self.thinking_enabled)
        reasoning, content = stream.delta(text, True)
        return reasoning or None, content or None

    def reasoning_end_token_ids(self) -> list[int] | None:
        return self._encode(self.end_tag) if self.thinking_enabled else None

    def reasoning_open_token_ids(self) -> list[int] | None:
        if not self.thinking_enabled or self.starts_in_reasoning(None):
            return None
        return self._encode(self.start_tag)


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    name = "qwen3"

    def starts_in_reasoning(self, text: str | None) -> bool:
        opened = self.prompt_opens_reasoning()
        if opened is not None:
            return opened
        # Prompt unknown: a closing tag without an opening one means the template opened it; a
        # stream cannot wait for that, so it assumes so from the start (as vLLM's does).
        return text is None or self.end_tag in text


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    name = "deepseek_r1"

    def starts_in_reasoning(self, text: str | None) -> bool:
        return True


class HarmonyReasoningStream(ReasoningStream):
    """Harmony messages routed as they grow: analysis -> reasoning; the rest -> content, function
    calls as harmony text (header when it is complete, arguments as they come, ``<|call|>`` at the end)."""

    def __init__(self) -> None:
        self.parser = HarmonyParser()
        self.first_open = 0  # messages before this one are fully routed
        self.sent_chars: dict[int, int] = {}

    def delta(self, new_text: str, finished: bool) -> tuple[str, str]:
        self.parser.feed(new_text, finished)
        reasoning, content = "", ""
        messages = self.parser.messages
        for index in range(self.first_open, len(messages)):
            message = messages[index]
            sent = self.sent_chars.get(index)
            is_call = message.function_name is not None
            text = message.text[sent or 0 :]
            if is_call and sent is None:
                text = message.header_text() + text
            if is_call and message.done:
                text += CALL
            if is_reasoning(message):
                reasoning += text
            else:
                content += text
            self.sent_chars[index] = len(message.text)
            if message.done:
                self.first_open = index + 1
        return reasoning, content


def is_reasoning(message: HarmonyMessage) -> bool:
    """Analysis text, and calls to the model's built-in tools (which this server does not run)."""
    if message.function_name is not None:
        return False
    return message.channel == "analysis" or message.recipient is not None


class GptOssReasoningParser(ReasoningParser):
    name = "gpt_oss"
    needs_special_tokens = True

    def stop_token_ids(self) -> list[int]:
        return harmony_stop_token_ids(self.tokenizer)

    def stream(self) -> HarmonyReasoningStream:
        return HarmonyReasoningStream()

    def reasoning_end_token_ids(self) -> list[int] | None:
        return self._encode(f"{CHANNEL}final{MESSAGE}")


def constraint_after_reasoning(spec: Any, parser: ReasoningParser) -> Any:
    """A StructuredOutputsParams that leaves the reasoning free: it starts after the parser's end of
    reasoning (from the first token, where the reply may skip reasoning and does). None stays None."""
    end = parser.reasoning_end_token_ids()
    if spec is None or not end:
        return spec
    opening = parser.reasoning_open_token_ids()
    # A multi-token opening cannot be told from the grammar's own first tokens: then reasoning is required.
    optional = opening[0] if opening is not None and len(opening) == 1 else None
    return dataclasses.replace(spec, start_after_token_ids=end, optional_open_token_id=optional)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
    GptOssReasoningParser.name: GptOssReasoningParser,
}
