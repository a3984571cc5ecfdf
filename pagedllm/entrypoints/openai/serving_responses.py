"""/v1/responses (OpenAI's Responses API) as a translation over the chat path.

A request becomes the chat request it means (responses_input.py), runs through
OpenAIServingChat unchanged (templates, tools, structured outputs, reasoning, errors), and its
reply is translated back (responses_output.py): a JSON Response, or the Responses event stream
made from the chat stream's chunks. Responses with ``store`` (the default) are kept in a bounded
in-memory store (response_store.py) for ``GET``/``DELETE`` and ``previous_response_id``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.response_store import ResponseStore, StoredResponse
from pagedllm.entrypoints.openai.responses_input import (
    chat_messages,
    chat_request_body,
    input_items,
    refuse_unsupported_fields,
)
from pagedllm.entrypoints.openai.responses_output import (
    ResponseStreamWriter,
    output_items,
    reasoning_of,
    response_object,
    usage,
)
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest, item_id
from pagedllm.entrypoints.openai.serving_base import APIError, ClosingStreamingResponse, bad_request, set_log_info
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat

# A chat request's field as the Responses request names it, for the errors the chat path raises.
_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
    "verbosity": "text",
    "reasoning_effort": "reasoning",
    "logprobs": "top_logprobs",
}
_WORDS = (
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format", "text.format"),
    ("reasoning_effort", "reasoning.effort"),
)


def _responses_error(error: APIError) -> APIError:
    """A chat error in the Responses request's terms (its field names)."""
    message = error.message
    for chat_word, responses_word in _WORDS:
        message = message.replace(chat_word, responses_word)
    if message.startswith("verbosity:"):
        message = "text." + message
    param = _PARAMS.get(error.param, error.param) if error.param is not None else None
    return APIError(
        error.status_code, message, param=param, code=error.code, err_type=error.err_type, headers=error.headers
    )


def _not_found(response_id: str, param: str | None = None, store: ResponseStore | None = None) -> APIError:
    refused = store.refused_size(response_id) if store is not None else None
    if refused is not None:
        message = (f"Response with id {response_id!r} was not stored: at {refused} bytes it is larger than the "
                   f"server's whole responses store ({store.max_bytes} bytes, --responses-store-max-bytes).")
    else:
        message = (f"Response with id {response_id!r} not found: responses are kept in memory, only while "
                   "they are among the server's most recent stored ones (by count and by size), and never with "
                   "store set to false.")
    return APIError(404, message, param=param, code="response_not_found")


def _only_reasoning(output: list[dict[str, Any]]) -> bool:
    return bool(output) and all(item["type"] == "reasoning" for item in output)


class OpenAIServingResponses:
    def __init__(self, serving_chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = serving_chat
        self.ctx = serving_chat.ctx
        self.store = store

    # ------------------------------------------------------------------------ stored responses

    def retrieve(self, response_id: str) -> JSONResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id, store=self.store)
        return JSONResponse(entry.response)

    def delete(self, response_id: str) -> JSONResponse:
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    def cancel(self, response_id: str) -> JSONResponse:
        if self.store.get(response_id) is None:
            raise _not_found(response_id)
        raise bad_request(
            "Only background responses can be cancelled, and this server runs none (background); "
            f"response {response_id!r} is finished already."
        )

    # ------------------------------------------------------------------------ create

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        ctx.check_model(request.model)
        refuse_unsupported_fields(request)
        items = input_items(request)
        previous: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            stored = self.store.get(request.previous_response_id)
            if stored is None:
                raise _not_found(request.previous_response_id, "previous_response_id", self.store)
            previous = stored.items
        conversation = previous + items
        body = chat_request_body(request, chat_messages(conversation, request.instructions))
        try:
            chat_request = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:  # items are checked already: a field's type, found by the chat's model
            first = exc.errors()[0]
            raise bad_request(f"{'.'.join(map(str, first['loc']))}: {first['msg']}", "input") from exc
        response_id = item_id("resp")
        created_at = int(time.time())
        try:
            chat_response = await self.chat.create_chat_completion(chat_request, raw_request)
        except APIError as exc:
            raise _responses_error(exc) from exc
        set_log_info(raw_request, id=response_id)
        if isinstance(chat_response, ClosingStreamingResponse):
            events = self._events(request, response_id, created_at, chat_response.body_iterator, conversation)
            return ClosingStreamingResponse(events, on_close=chat_response.on_close)
        if not isinstance(chat_response, JSONResponse) or chat_response.status_code != 200:
            return chat_response  # the client went away (499)
        chat = json.loads(chat_response.body)
        choice = chat["choices"][0]
        incomplete = choice["finish_reason"] == "length"
        output = output_items(choice["message"], choice.get("logprobs"), incomplete)
        reasoning_tokens = await self._count_tokens(reasoning_of(choice["message"]))
        response = response_object(
            request,
            response_id,
            created_at,
            ctx.model_name,
            "incomplete" if incomplete else "completed",
            output,
            usage(chat.get("usage"), reasoning_tokens, _only_reasoning(output)),
        )
        self._store(request, response, conversation)
        return JSONResponse(response)

    def _store(self, request: ResponsesRequest, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if request.store is not False:
            self.store.put(response["id"], StoredResponse(response, conversation + response["output"]))

    async def _count_tokens(self, text: str | None) -> int:
        if not text:
            return 0
        tokenizer = self.ctx.tokenizer
        token_ids = await self.ctx.run_in_tokenizer_thread(lambda: tokenizer.encode(text, add_special_tokens=False))
        return len(token_ids)

    async def _events(
        self,
        request: ResponsesRequest,
        response_id: str,
        created_at: int,
        chat_stream: AsyncIterator[str],
        conversation: list[dict[str, Any]],
    ) -> AsyncGenerator[str, None]:
        """The Responses event stream, made from the chat stream's SSE chunks."""
        ctx = self.ctx
        writer = ResponseStreamWriter()

        def snapshot(status: str, response_usage: dict[str, Any] | None = None) -> dict[str, Any]:
            return response_object(
                request, response_id, created_at, ctx.model_name, status, list(writer.output), response_usage
            )

        finish_reason: str | None = None
        chat_usage: dict[str, Any] | None = None
        try:
            yield writer.event("response.created", response=snapshot("in_progress"))
            yield writer.event("response.in_progress", response=snapshot("in_progress"))
            async for raw in chat_stream:
                data = raw.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # the chat stream's error: the same, as a Responses error event
                    error = chunk["error"]
                    yield writer.event(
                        "error", code=error.get("code"), message=error.get("message"), param=error.get("param")
                    )
                    return
                chat_usage = chunk.get("usage") or chat_usage
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    events: list[str] = []
                    reasoning = reasoning_of(delta)
                    if reasoning:
                        events += writer.reasoning(reasoning)
                    if delta.get("content"):
                        logprobs = (choice.get("logprobs") or {}).get("content")
                        events += writer.text(delta["content"], logprobs)
                    for call in delta.get("tool_calls") or []:
                        events += writer.tool_call(call)
                    finish_reason = choice.get("finish_reason") or finish_reason
                    for event in events:
                        yield event
            status = "incomplete" if finish_reason == "length" else "completed"
            if writer.open is None and not writer.output:  # an empty reply is an empty message
                for event in writer.text("", None):
                    yield event
            for event in writer.close(status):
                yield event
            reasoning_tokens = await self._count_tokens(writer.reasoning_text)
            response_usage = usage(chat_usage, reasoning_tokens, _only_reasoning(writer.output))
            response = snapshot(status, response_usage)
            self._store(request, response, conversation)
            yield writer.event(f"response.{status}", response=response)
        finally:
            aclose = getattr(chat_stream, "aclose", None)
            if aclose is not None:
                await aclose()
