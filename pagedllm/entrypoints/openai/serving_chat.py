"""POST /v1/chat/completions: messages (and tools) rendered with a chat template, streamed or not."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.chat_utils import render_chat_checked
from pagedllm.entrypoints.openai.chat_tools import ToolCallStream, ToolPlan, parse_reply, tool_plan
from pagedllm.entrypoints.openai.protocol import (
    ChatChoiceLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    random_id,
)
from pagedllm.entrypoints.openai.reasoning_parsers import (
    ReasoningParser,
    ReasoningStream,
    constraint_after_reasoning,
)
from pagedllm.entrypoints.openai.request_fields import (
    chat_template_kwargs,
    refuse_unsupported_chat_fields,
    structured_outputs,
)
from pagedllm.entrypoints.openai.serving_base import (
    ClosingStreamingResponse,
    ServingContext,
    bad_request,
    set_log_info,
)
from pagedllm.entrypoints.openai.serving_completion import finite, vllm_prompt_logprobs
from pagedllm.entrypoints.openai.streaming import ChoiceDelta, DeltaTracker, event_stream, final_outputs
from pagedllm.entrypoints.openai.tool_parsers import ToolParser
from pagedllm.entrypoints.template_sandbox import TemplateLimits

logger = logging.getLogger("pagedllm.api")

_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _arguments_for_template(arguments: str) -> Any:
    # Chat templates (Hugging Face's convention) expect the arguments as a mapping.
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template reads them; text parts of a content list are joined."""
    if not messages:
        raise bad_request("messages must hold at least one message.", "messages")
    result: list[dict[str, Any]] = []
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
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        for name in ("name", "refusal"):
            if getattr(message, name) is not None:
                entry[name] = getattr(message, name)
        reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
        if reasoning is not None:  # Qwen3's template reads reasoning_content, GPT-OSS's thinking
            entry["reasoning_content"] = entry["thinking"] = reasoning
        if message.tool_calls:
            if message.role != "assistant":
                raise bad_request(f"messages[{i}]: only assistant messages carry tool_calls.", f"messages.{i}")
            entry["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {
                    "name": call.function.name, "arguments": _arguments_for_template(call.function.arguments)}}
                for call in message.tool_calls
            ]
        if message.role == "tool":
            if message.tool_call_id is None:
                raise bad_request(f"messages[{i}]: a tool message needs tool_call_id.", f"messages.{i}.tool_call_id")
            entry["tool_call_id"] = message.tool_call_id
        result.append(entry)
    return result


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


def _finish_reason(reason: str | None, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and reason == "stop" else reason


class OpenAIServingChat:
    def __init__(
        self,
        ctx: ServingContext,
        chat_template: str | None = None,
        response_role: str = "assistant",
        tool_parser: ToolParser | None = None,
        enable_auto_tool_choice: bool = False,
        reasoning_parser: type[ReasoningParser] | None = None,
        trust_request_chat_template: bool = False,
        template_limits: TemplateLimits | None = None,
    ) -> None:
        self.ctx = ctx
        self.chat_template = chat_template
        # A template is a program run on the server: a request's own runs only where the operator says so.
        self.trust_request_chat_template = trust_request_chat_template
        self.template_limits = template_limits or TemplateLimits()
        self.response_role = response_role
        self.tool_parser = tool_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning_parser = reasoning_parser  # --reasoning-parser: one instance per request

    def _reasoning_parser(self, request: ChatCompletionRequest) -> ReasoningParser | None:
        """This request's reasoning parser (it knows chat_template_kwargs; the prompt comes after rendering)."""
        if self.reasoning_parser is None:
            return None
        parser = self.reasoning_parser(self.ctx.tokenizer, chat_template_kwargs=request.chat_template_kwargs)
        if parser.needs_special_tokens:
            request.skip_special_tokens = False  # the reply's markers are special tokens: keep them in the text
        return parser

    def request_template(self, request: Any) -> tuple[str | None, dict[str, Any] | None]:
        """(the template to render with, the template kwargs left) for a request; a template sent with
        it (``chat_template``, or ``chat_template_kwargs.chat_template`` as vLLM reads it) is a 400
        unless the server trusts request templates."""
        kwargs = getattr(request, "chat_template_kwargs", None)
        sent = getattr(request, "chat_template", None)
        if kwargs and kwargs.get("chat_template") is not None:
            kwargs = {k: v for k, v in kwargs.items() if k != "chat_template"}
            sent = sent or request.chat_template_kwargs["chat_template"]
        if sent is None:
            return self.chat_template, kwargs
        if not self.trust_request_chat_template:
            raise bad_request(
                "A chat template was sent with the request, but this server was not started with "
                "--trust-request-chat-template; it renders only its own template (the model's or --chat-template).",
                "chat_template",
            )
        if not isinstance(sent, str):
            raise bad_request("chat_template must be a string.", "chat_template")
        return sent, kwargs

    def render(self, request: Any, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        """On the tokenizer thread: the chat template applied and tokenized; ValueError says what is wrong."""
        template, kwargs = self.request_template(request)
        return render_chat_checked(
            self.ctx.tokenizer,
            conversation(request.messages or []),
            chat_template=template,
            add_generation_prompt=request.add_generation_prompt,
            tools=tools,
            continue_final_message=getattr(request, "continue_final_message", False),
            template_kwargs=kwargs,
            limits=self.template_limits,
        )

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        ctx.check_model(request.model)
        ctx.async_engine.check_alive()
        refuse_unsupported_chat_fields(request)
        self.request_template(request)  # an untrusted template is refused before anything else is done
        if request.stream and request.best_of is not None and request.best_of != request.n:
            raise bad_request("best_of must equal n (or be left out) when streaming.", "best_of")
        if request.stream and request.use_beam_search:
            raise bad_request("Beam search cannot stream; set stream to false.", "use_beam_search")
        if request.continue_final_message and request.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true.",
                              "continue_final_message")
        top_logprobs: int | None = None
        if request.logprobs:
            top_logprobs = request.top_logprobs or 0
        elif request.top_logprobs is not None:
            raise bad_request("top_logprobs needs logprobs set to true.", "top_logprobs")
        if top_logprobs is not None and not 0 <= top_logprobs <= 20:
            raise bad_request(f"top_logprobs must be an integer in [0, 20], got {top_logprobs}.", "top_logprobs")
        request.chat_template_kwargs = chat_template_kwargs(request)  # with reasoning_effort, checked
        reasoning = self._reasoning_parser(request)
        plan = tool_plan(request, self.tool_parser, self.enable_auto_tool_choice)
        spec, spec_field = structured_outputs(request)
        if plan.constraint is not None:
            if spec is not None:
                raise bad_request(f"tool_choice {plan.mode!r} constrains the reply already; drop {spec_field}.",
                                  spec_field)
            spec, spec_field = plan.constraint, "tools"
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        params = ctx.make_sampling_params(request, max_tokens, top_logprobs, spec)
        # Formats whose replies end at more than the tokenizer's EOS (harmony: <|call|> and <|return|>).
        format_stops = [*(reasoning.stop_token_ids() if reasoning is not None else []),
                        *(plan.parser.stop_token_ids(ctx.tokenizer) if plan.parser is not None else [])]
        if format_stops:
            params.stop_token_ids = list(dict.fromkeys([*params.stop_token_ids, *format_stops]))
        await ctx.compile_grammar(spec, spec_field)
        try:
            text, token_ids = await ctx.run_in_tokenizer_thread(self.render, request, plan.tools)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from exc
        ctx.check_length(len(token_ids), max_tokens, "messages")
        if reasoning is not None:
            reasoning.prompt = text  # whether the template opened the reasoning already
            # The thinking is free; a constraint starts once the model has ended it.
            params.structured_outputs = params.guided_decoding = constraint_after_reasoning(
                params.structured_outputs, reasoning)
        request_id = random_id("chatcmpl")
        set_log_info(raw_request, id=request_id, **ctx.identity(request))
        await ctx.add_requests([request_id], [{"prompt_token_ids": token_ids, "prompt": text}], params, "messages",
                               priority=request.priority, prompt_cache_key=request.prompt_cache_key)
        streams = [ctx.async_engine.stream_outputs(request_id)]
        role = self.response_role if request.add_generation_prompt else request.messages[-1].role
        # vLLM's echo: a reply in the last message's role starts with that message's text.
        echo = ""
        if request.echo and request.messages[-1].role == role:
            echo = conversation(request.messages[-1:])[0]["content"]
        if request.stream:
            return ClosingStreamingResponse(
                self._stream(request, raw_request, request_id, role, echo, plan, top_logprobs,
                             params.stop_strings, streams, reasoning),
                on_close=lambda: ctx.abort_unfinished([request_id]),
            )
        finals = await final_outputs(ctx, raw_request, [request_id], streams)
        if finals is None:
            return Response(status_code=499)
        final = finals[0]
        tracker = DeltaTracker(request.n, [])
        tracker.deltas(0, final)
        choices = []
        for completion in final.outputs:
            logprobs = None
            if top_logprobs is not None and completion.logprobs is not None:
                logprobs = chat_logprobs(ctx, completion.token_ids, completion.logprobs, top_logprobs)
            thinking, reply = None, completion.text
            if reasoning is not None:  # tool calls are read from the content alone
                thinking, reply = reasoning.extract(completion.text)
            content, calls = parse_reply(plan, reply or "")
            if echo and not calls:
                content = echo + (content or "")
            if reasoning is not None and not content:
                content = None
            message = ChatResponseMessage(role=role, content=content, tool_calls=[c.to_openai() for c in calls],
                                          reasoning_content=thinking, reasoning=thinking)
            choices.append(
                ChatCompletionResponseChoice(
                    index=completion.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=_finish_reason(completion.finish_reason, bool(calls)),
                    stop_reason=completion.stop_reason,
                )
            )
        usage = tracker.usage()
        set_log_info(raw_request, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)
        prompt_logprobs = None
        if request.prompt_logprobs is not None:
            prompt_logprobs = vllm_prompt_logprobs(ctx, final.prompt_token_ids, final.prompt_logprobs)
        response = ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=usage,
                                          prompt_logprobs=prompt_logprobs)
        return JSONResponse(response.model_dump())

    def _stream(
        self,
        request: ChatCompletionRequest,
        raw_request: Request,
        request_id: str,
        role: str,
        echo: str,
        plan: ToolPlan,
        top_logprobs: int | None,
        stop_strings: list[str],
        streams: list[Any],
        reasoning: ReasoningParser | None = None,
    ):
        ctx = self.ctx
        created = int(time.time())
        tool_streams: dict[int, ToolCallStream] = {}
        reasoning_streams: dict[int, ReasoningStream] = {}

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name,
                    "choices": choices}

        def choice_chunks(delta: ChoiceDelta) -> list[dict[str, Any]]:
            state = tool_streams.setdefault(delta.index, ToolCallStream(plan))
            text, thinking = delta.text, ""
            if reasoning is not None:
                if delta.index not in reasoning_streams:
                    reasoning_streams[delta.index] = reasoning.stream()
                thinking, text = reasoning_streams[delta.index].delta(delta.text, delta.finished)
            messages = state.delta(text, delta.finished)
            if thinking:
                messages.insert(0, {"reasoning_content": thinking, "reasoning": thinking})
            logprobs = None
            new_token_ids = delta.new_token_ids
            if top_logprobs is not None and delta.completion.logprobs is not None and new_token_ids:
                logprobs = chat_logprobs(ctx, new_token_ids, delta.completion.logprobs[delta.first_token :],
                                         top_logprobs).model_dump()
            if not messages and (logprobs is not None or delta.finished):
                messages = [{}]
            choices = [{"index": delta.index, "delta": message, "logprobs": None, "finish_reason": None}
                       for message in messages]
            if choices:
                choices[0]["logprobs"] = logprobs
                if delta.finished:
                    choices[-1]["finish_reason"] = _finish_reason(delta.completion.finish_reason,
                                                                  state.sent_calls > 0)
                    choices[-1]["stop_reason"] = delta.completion.stop_reason
            return choices

        # OpenAI opens every choice with the role and empty content (here: what echo repeats).
        opening = [{"index": i, "delta": {"role": role, "content": echo}, "logprobs": None, "finish_reason": None}
                   for i in range(request.n)]
        tracker = DeltaTracker(request.n, stop_strings)
        return event_stream(ctx, raw_request, streams, tracker, chunk, choice_chunks, request.stream_options, opening)
