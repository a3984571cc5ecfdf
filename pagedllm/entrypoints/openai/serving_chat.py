"""POST /v1/chat/completions: messages rendered with the model's chat template, streamed or not."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.llm import render_chat
from pagedllm.entrypoints.openai.protocol import (
    ChatChoiceLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.serving_base import (
    ClosingStreamingResponse,
    ServingContext,
    bad_request,
    merge_streams,
    run_until_disconnect,
    set_log_info,
    sse,
    stop_holdback,
)
from pagedllm.entrypoints.openai.serving_completion import finite
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import RequestOutput

logger = logging.getLogger("pagedllm.api")

_ROLES = {"system", "developer", "user", "assistant", "tool"}


def conversation(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Plain {"role", "content"} dicts for the template; text parts of a content list are joined."""
    if not messages:
        raise bad_request("messages must hold at least one message.", "messages")
    result: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if message.role not in _ROLES:
            raise bad_request(
                f"messages[{i}].role must be one of {sorted(_ROLES)}, got {message.role!r}.", f"messages.{i}.role"
            )
        content = message.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(
                        f"messages[{i}].content: only text parts are supported, got {part.get('type')!r}.",
                        f"messages.{i}.content",
                    )
                parts.append(part["text"])
            content = "\n".join(parts)
        result.append({"role": message.role, "content": content or ""})
    return result


def render_chat_checked(
    tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool
) -> tuple[str, list[int]]:
    """render_chat whose failures are ValueErrors a client can act on, never a Python error's text.

    A template's own error (jinja2 TemplateError, e.g. raise_exception("roles must alternate")) is
    the template author's message about the conversation, and is passed on.
    """
    try:
        return render_chat(tokenizer, messages, None, add_generation_prompt)
    except ValueError:
        raise
    except jinja2.TemplateError as exc:
        raise ValueError(f"The chat template refused these messages: {exc.message or 'no reason given'}") from exc
    except Exception as exc:  # noqa: BLE001 - tokenizer and template internals: log, answer plainly
        logger.warning("rendering a chat failed", exc_info=exc)
        raise ValueError(
            "These messages could not be rendered with the model's chat template; check their roles and contents."
        ) from exc


def chat_logprobs(
    ctx: ServingContext, token_ids: list[int], logprobs: list[dict[int, float]], top_k: int
) -> ChatChoiceLogProbs:
    content = []
    for token_id, top in zip(token_ids, logprobs):
        text = ctx.token_text(token_id)
        chosen = top.get(token_id)
        ranked = sorted(top.items(), key=lambda item: item[1], reverse=True)[:top_k]
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=finite(chosen) if chosen is not None else -9999.0,
                bytes=list(text.encode("utf-8")),
                top_logprobs=[
                    ChatTopLogprob(
                        token=ctx.token_text(t), logprob=finite(v), bytes=list(ctx.token_text(t).encode("utf-8"))
                    )
                    for t, v in ranked
                ],
            )
        )
    return ChatChoiceLogProbs(content=content)


class OpenAIServingChat:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> tuple[str, list[int]]:
        """On the engine thread: the chat template applied and tokenized; template errors are 400s."""
        return render_chat_checked(self.ctx.tokenizer, messages, add_generation_prompt)

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        ctx.check_model(request.model)
        ctx.async_engine.check_alive()
        if request.logit_bias:
            raise bad_request("logit_bias is not supported.", "logit_bias")
        if request.stream and request.best_of is not None and request.best_of != request.n:
            raise bad_request("best_of must equal n (or be left out) when streaming.", "best_of")
        if request.stream and request.use_beam_search:
            raise bad_request("Beam search cannot stream; set stream to false.", "use_beam_search")
        top_logprobs: int | None = None
        if request.logprobs:
            top_logprobs = request.top_logprobs or 0
        elif request.top_logprobs is not None:
            raise bad_request("top_logprobs needs logprobs set to true.", "top_logprobs")
        if top_logprobs is not None and not 0 <= top_logprobs <= 20:
            raise bad_request(f"top_logprobs must be an integer in [0, 20], got {top_logprobs}.", "top_logprobs")
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        params = ctx.make_sampling_params(request, max_tokens, top_logprobs)
        messages = conversation(request.messages)
        try:
            text, token_ids = await ctx.async_engine.run_in_engine_thread(
                self._render, messages, request.add_generation_prompt
            )
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from exc
        ctx.check_length(len(token_ids), max_tokens, "messages")
        request_id = random_id("chatcmpl")
        set_log_info(raw_request, id=request_id)
        await ctx.add_requests([request_id], [{"prompt_token_ids": token_ids, "prompt": text}], params, "messages")
        stream = ctx.async_engine.stream_outputs(request_id)
        if request.stream:
            return ClosingStreamingResponse(
                self._stream(request, raw_request, request_id, params, top_logprobs, stream),
                on_close=lambda: ctx.abort_unfinished([request_id]),
            )

        async def collect() -> RequestOutput | None:
            final = None
            try:
                async for output in stream:
                    final = output
            finally:
                ctx.abort_unfinished([request_id])
            return final

        try:
            final = await run_until_disconnect(raw_request, collect(), lambda: ctx.abort_unfinished([request_id]))
        except Exception as exc:
            raise ctx.engine_error(exc) from exc
        if final is None:
            return Response(status_code=499)
        choices = []
        num_generated = 0
        for completion in final.outputs:
            num_generated += len(completion.token_ids)
            logprobs = None
            if top_logprobs is not None and completion.logprobs is not None:
                logprobs = chat_logprobs(ctx, completion.token_ids, completion.logprobs, top_logprobs)
            choices.append(
                ChatCompletionResponseChoice(
                    index=completion.index,
                    message=ChatResponseMessage(content=completion.text),
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
            )
        num_prompt = len(final.prompt_token_ids)
        set_log_info(raw_request, prompt_tokens=num_prompt, completion_tokens=num_generated)
        response = ChatCompletionResponse(
            id=request_id,
            model=ctx.model_name,
            choices=choices,
            usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                            total_tokens=num_prompt + num_generated),
        )
        return JSONResponse(response.model_dump())

    async def _stream(
        self,
        request: ChatCompletionRequest,
        raw_request: Request,
        request_id: str,
        params: SamplingParams,
        top_logprobs: int | None,
        stream: Any,
    ) -> AsyncGenerator[str, None]:
        ctx = self.ctx
        created = int(time.time())
        include_usage = bool(request.stream_options and request.stream_options.include_usage)

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
            body: dict[str, Any] = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": ctx.model_name,
                "choices": choices,
            }
            if include_usage:
                body["usage"] = usage
            return sse(body)

        sent_chars: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finished: set[int] = set()
        num_prompt = num_generated = 0
        try:
            # OpenAI opens every choice with the assistant role and empty content.
            yield chunk(
                [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    for i in range(request.n)
                ]
            )
            async for _, output in merge_streams([stream]):
                num_prompt = len(output.prompt_token_ids)
                num_generated = sum(len(c.token_ids) for c in output.outputs)
                for completion in output.outputs:
                    index = completion.index
                    if index in finished:
                        continue
                    done = completion.finish_reason is not None
                    text = completion.text
                    start = sent_chars.get(index, 0)
                    end = len(text) if done else len(text) - stop_holdback(text, params.stop_strings)
                    end = max(end, start)
                    first_token = sent_tokens.get(index, 0)
                    new_token_ids = completion.token_ids[first_token:]
                    want_logprobs = top_logprobs is not None and completion.logprobs is not None
                    if end == start and not done and not (want_logprobs and new_token_ids):
                        continue
                    logprobs = None
                    if want_logprobs:
                        logprobs = chat_logprobs(
                            ctx, new_token_ids, completion.logprobs[first_token:], top_logprobs  # type: ignore[arg-type,index]
                        ).model_dump()
                    delta = {"content": text[start:end]} if end > start else {}
                    yield chunk(
                        [
                            {
                                "index": index,
                                "delta": delta,
                                "logprobs": logprobs,
                                "finish_reason": completion.finish_reason if done else None,
                                "stop_reason": completion.stop_reason if done else None,
                            }
                        ]
                    )
                    sent_chars[index] = end
                    sent_tokens[index] = len(completion.token_ids)
                    if done:
                        finished.add(index)
            set_log_info(raw_request, prompt_tokens=num_prompt, completion_tokens=num_generated)
            if include_usage:
                usage = UsageInfo(
                    prompt_tokens=num_prompt, completion_tokens=num_generated, total_tokens=num_prompt + num_generated
                )
                yield chunk([], usage.model_dump())
        except GeneratorExit:
            set_log_info(raw_request, disconnected=True)
            raise
        except Exception as exc:  # noqa: BLE001 - the status line is sent: report in the stream
            error = ctx.engine_error(exc)
            set_log_info(raw_request, error=error.message[:200], error_status=error.status_code)
            yield sse(error.body())
        yield sse("[DONE]")
