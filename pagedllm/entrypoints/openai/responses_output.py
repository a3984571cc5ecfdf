"""A chat completion's reply as Responses output: output items, the Response object, stream events.

A reply becomes, in order: a ``reasoning`` item (the chat message's ``reasoning_content``), a
``message`` item with one ``output_text`` part (its content), one ``function_call`` item per tool
call. The stream writer turns the chat stream's deltas into the Responses event sequence, every
event numbered by ``sequence_number``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest, item_id


def reasoning_of(message: dict[str, Any]) -> str | None:
    """A chat message's (or delta's) reasoning text, under vLLM's older or newer name."""
    return message.get("reasoning_content") or message.get("reasoning")


def reasoning_item(text: str, status: str = "completed", rid: str | None = None) -> dict[str, Any]:
    return {
        "id": rid or item_id("rs"),
        "type": "reasoning",
        "summary": [],
        "status": status,
        "content": [{"type": "reasoning_text", "text": text}] if text else [],
    }


def message_item(
    text: str, logprobs: list[dict[str, Any]] | None, status: str = "completed", mid: str | None = None
) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": mid or item_id("msg"), "type": "message", "role": "assistant", "status": status, "content": [part]}


def function_call_item(
    call_id: str, name: str, arguments: str, status: str = "completed", fid: str | None = None
) -> dict[str, Any]:
    return {
        "id": fid or item_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict[str, Any], logprobs: dict[str, Any] | None, incomplete: bool) -> list[dict[str, Any]]:
    """The output items of a finished chat message."""
    status = "incomplete" if incomplete else "completed"
    items = []
    reasoning = reasoning_of(message)
    if reasoning:
        items.append(reasoning_item(reasoning, status))
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if content or not (calls or reasoning):  # a reply of nothing at all is an empty message
        token_logprobs = (logprobs or {}).get("content") if logprobs is not None else None
        items.append(message_item(content or "", token_logprobs, status))
    for call in calls:
        items.append(function_call_item(call["id"], call["function"]["name"], call["function"]["arguments"], status))
    return items


def usage(chat_usage: dict[str, Any] | None, reasoning_tokens: int, only_reasoning: bool) -> dict[str, Any] | None:
    """Responses' usage from the chat's. ``reasoning_tokens``: the reasoning text re-tokenized (the
    reply's tokens are not split by the parser), so at most the output; all of it when the reply
    is reasoning only."""
    if chat_usage is None:
        return None
    output_tokens = chat_usage["completion_tokens"]
    reasoning_tokens = output_tokens if only_reasoning else min(reasoning_tokens, output_tokens)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": chat_usage["total_tokens"],
    }


def response_object(
    request: ResponsesRequest,
    response_id: str,
    created_at: int,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    response_usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Response object: the request's settings echoed around the output, as OpenAI returns it."""
    text_format = request.text.format if request.text is not None and request.text.format else {"type": "text"}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": None,
        "metadata": request.metadata or {},
        "model": model,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "prompt_cache_key": request.prompt_cache_key,
        "reasoning": {"effort": request.reasoning.effort if request.reasoning else None, "summary": None},
        "safety_identifier": request.safety_identifier,
        "service_tier": request.service_tier or "default",
        "store": request.store is not False,
        "temperature": request.temperature if request.temperature is not None else 1.0,
        "text": {"format": text_format},
        "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
        "tools": request.tools or [],
        "top_logprobs": request.top_logprobs or 0,
        "top_p": request.top_p if request.top_p is not None else 1.0,
        "truncation": "disabled",
        "usage": response_usage,
        "user": request.user,
    }


def sse_event(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


@dataclass
class _OpenItem:
    output_index: int
    item: dict[str, Any]
    text: str = ""  # the reasoning or message text, or a call's arguments
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    chat_index: int | None = None  # a function call's index among the chat's tool_calls


class ResponseStreamWriter:
    """The Responses events of one reply, as its chat deltas arrive: at most one output item is open at
    a time; a new kind of delta closes it (reasoning, then text, then each call)."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: _OpenItem | None = None
        self.reasoning_text = ""

    def event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return sse_event(event)

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open.item["id"], "output_index": self.open.output_index}

    def _open(self, item: dict[str, Any], part: dict[str, Any] | None, chat_index: int | None = None) -> list[str]:
        events = self.close()
        self.open = _OpenItem(len(self.output), item, chat_index=chat_index)
        events.append(self.event("response.output_item.added", output_index=self.open.output_index, item=item))
        if part is not None:
            events.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return events

    def reasoning(self, delta: str) -> list[str]:
        events = []
        if self.open is None or self.open.item["type"] != "reasoning":
            item = reasoning_item("", "in_progress")
            events += self._open(item, {"type": "reasoning_text", "text": ""})
        self.open.text += delta
        self.reasoning_text += delta
        events.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=delta))
        return events

    def text(self, delta: str, logprobs: list[dict[str, Any]] | None) -> list[str]:
        events = []
        if self.open is None or self.open.item["type"] != "message":
            item = {**message_item("", None, "in_progress"), "content": []}
            events += self._open(item, {"type": "output_text", "text": "", "annotations": []})
        self.open.text += delta
        self.open.logprobs += logprobs or []
        if delta:
            events.append(
                self.event(
                    "response.output_text.delta", **self._where(), content_index=0, delta=delta, logprobs=logprobs or []
                )
            )
        return events

    def tool_call(self, call: dict[str, Any]) -> list[str]:
        """One chat tool_call delta: a new call (it has an id) opens an item; argument text follows."""
        events = []
        function = call.get("function") or {}
        if call.get("id") is not None:
            item = function_call_item(call["id"], function.get("name", ""), "", "in_progress")
            events += self._open(item, None, chat_index=call.get("index"))
        if self.open is None or self.open.item["type"] != "function_call":
            return events  # arguments with no call open: nothing to attach them to
        arguments = function.get("arguments") or ""
        if arguments:
            self.open.text += arguments
            events.append(self.event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return events

    def close(self, status: str = "completed") -> list[str]:
        """Close the open item (if any): its done events, with the whole text."""
        if self.open is None:
            return []
        open_item, events = self.open, []
        where = self._where()
        kind = open_item.item["type"]
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": open_item.text}
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=open_item.text))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
            item = reasoning_item(open_item.text, status, open_item.item["id"])
        elif kind == "message":
            logprobs = open_item.logprobs
            events.append(
                self.event(
                    "response.output_text.done", **where, content_index=0, text=open_item.text, logprobs=logprobs
                )
            )
            item = message_item(open_item.text, logprobs or None, status, open_item.item["id"])
            events.append(self.event("response.content_part.done", **where, content_index=0, part=item["content"][0]))
        else:
            item = function_call_item(
                open_item.item["call_id"], open_item.item["name"], open_item.text, status, open_item.item["id"]
            )
            events.append(
                self.event(
                    "response.function_call_arguments.done", **where, name=item["name"], arguments=open_item.text
                )
            )
        events.append(self.event("response.output_item.done", output_index=open_item.output_index, item=item))
        self.output.append(item)
        self.open = None
        return events
