"""OpenAI's harmony format (GPT-OSS replies), split into messages as the text arrives.

A reply continues a prompt that ends with ``<|start|>assistant`` and is a run of messages::

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

Each message has a header (role, ``<|channel|>`` name, an optional recipient ``to=...``, which
may also follow the role, and an optional content type) closed by ``<|message|>``, then a body
closed by ``<|end|>``, ``<|return|>`` or ``<|call|>`` (or by the end of the reply: the engine
drops stop tokens from the text). Text before any header is read as a final-channel message (a
model that ignored the format), so nothing is lost.

The markers are special tokens, which the detokenizer drops by default: the chat server turns
``skip_special_tokens`` off for a request whenever a harmony parser reads it (the gpt_oss reasoning
parser, the openai tool parser), and adds ``<|call|>`` and ``<|return|>`` to its stop tokens. Each
marker is one token spelled as its text, so splitting that text splits the token ids (vLLM parses
the ids with openai_harmony); reading text lets harmony ride on what every parser already gets per
choice (incremental detokenizing, stop strings, n > 1, streamed deltas). The one thing text cannot
tell apart is a marker spelled out of ordinary tokens, which a model trained on harmony does not write.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
# A body ends at one of these; a header marker also ends it (a model that skipped <|end|>).
_BODY_ENDS = (END, RETURN, CALL)
_HEADER_STARTS = (START, CHANNEL)
_MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
_RECIPIENT = re.compile(r"\bto=(\S+)")
FUNCTION_PREFIX = "functions."


@dataclass
class HarmonyMessage:
    channel: str  # "analysis", "commentary", "final"; "final" for text outside any header
    recipient: str | None = None  # e.g. "functions.get_weather"
    content_type: str | None = None  # e.g. "json"
    text: str = ""
    done: bool = False
    ended_by: str | None = None  # the marker that closed the body (None: the reply ended)

    @property
    def function_name(self) -> str | None:
        """The function a tool-call message calls (recipient ``functions.NAME``), else None."""
        if self.recipient and self.recipient.startswith(FUNCTION_PREFIX):
            return self.recipient[len(FUNCTION_PREFIX) :]
        return None

    def header_text(self) -> str:
        """The message's header as harmony writes it (for a tool call re-emitted as text)."""
        header = f"{CHANNEL}{self.channel}"
        if self.recipient:
            header += f" to={self.recipient}"
        if self.content_type:
            header += f" {CONSTRAIN}{self.content_type}"
        return header + MESSAGE


def parse_header(header: str) -> HarmonyMessage:
    """A message (empty body) from the text before ``<|message|>``."""
    role_part, _, channel_part = header.partition(CHANNEL)
    channel_part, _, constrain = channel_part.partition(CONSTRAIN)
    words = channel_part.split()
    channel = words[0] if words else "final"
    match = _RECIPIENT.search(role_part) or _RECIPIENT.search(channel_part)
    content_type = constrain.strip() or None
    if content_type is None:  # "commentary to=functions.f json" also names the type, without <|constrain|>
        rest = [w for w in words[1:] if not w.startswith("to=")]
        content_type = rest[0] if rest else None
    return HarmonyMessage(channel=channel, recipient=match.group(1) if match else None, content_type=content_type)


def partial_marker_len(text: str, markers: tuple[str, ...] = _MARKERS) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``markers``."""
    start = text.rfind("<", max(0, len(text) - max(len(m) for m in markers)))
    while start != -1:
        tail = text[start:]
        if any(m.startswith(tail) and m != tail for m in markers):
            return len(tail)
        start = text.find("<", start + 1)
    return 0


class HarmonyParser:
    """Incremental: ``feed`` text as it arrives; ``messages`` grows, the last one possibly open.

    ``feed`` returns the body text each message gained, as (message index, text); a message
    appears in ``messages`` as soon as its header is complete, before any body text.
    """

    def __init__(self) -> None:
        self.messages: list[HarmonyMessage] = []
        self._pending = ""  # text not yet consumed: a header in progress or a possible partial marker
        self._in_body = False

    def feed(self, text: str, finished: bool = False) -> list[tuple[int, str]]:
        self._pending += text
        gained: list[tuple[int, str]] = []
        while True:
            if self._in_body:
                if not self._read_body(gained, finished):
                    break
            elif not self._read_header(finished):
                break
        return gained

    def _read_header(self, finished: bool) -> bool:
        """Consume a complete header (True), or wait for more text (False)."""
        pending = self._pending
        stripped = pending.lstrip()
        if not stripped:
            return False
        if not stripped.startswith("<") or not any(stripped.startswith(m) or m.startswith(stripped) for m in _MARKERS):
            # Text outside any header: a final-channel message without one.
            self.messages.append(HarmonyMessage(channel="final"))
            self._in_body = True
            return True
        index = pending.find(MESSAGE)
        if index == -1:
            if finished:
                self._pending = ""  # a header cut short (max_tokens): no message to report
            return False
        header = pending[:index]
        for end in _BODY_ENDS:  # stray end markers between messages carry nothing
            header = header.replace(end, "")
        self.messages.append(parse_header(header.replace(START, " ")))
        self._pending = pending[index + len(MESSAGE) :]
        self._in_body = True
        return True

    def _read_body(self, gained: list[tuple[int, str]], finished: bool) -> bool:
        """Move body text into the open message; True when the body ended (a header may follow)."""
        message = self.messages[-1]
        pending = self._pending
        found, marker = -1, ""
        for candidate in _BODY_ENDS + _HEADER_STARTS:
            index = pending.find(candidate)
            if index != -1 and (found == -1 or index < found):
                found, marker = index, candidate
        if found == -1:
            keep = 0 if finished else partial_marker_len(pending)
            body = pending[: len(pending) - keep]
            self._pending = pending[len(body) :]
            self._add(message, body, gained)
            if finished:
                message.done = True
                self._in_body = False
            return False
        self._add(message, pending[:found], gained)
        message.done = True
        if marker in _BODY_ENDS:
            message.ended_by = marker
            found += len(marker)
        self._pending = pending[found:]
        self._in_body = False
        return True

    def _add(self, message: HarmonyMessage, text: str, gained: list[tuple[int, str]]) -> None:
        if text:
            message.text += text
            gained.append((len(self.messages) - 1, text))


def parse_harmony(text: str) -> list[HarmonyMessage]:
    """Every message of a finished reply."""
    parser = HarmonyParser()
    parser.feed(text, finished=True)
    return parser.messages


def harmony_stop_token_ids(tokenizer: Any) -> list[int]:
    """The ids of ``<|call|>`` and ``<|return|>`` where each is one token: either ends a GPT-OSS reply
    (GPT-OSS's generation config lists both as end tokens; a tokenizer names only one EOS)."""
    found = []
    for marker in (CALL, RETURN):
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1:
            found.append(int(ids[0]))
    return found
