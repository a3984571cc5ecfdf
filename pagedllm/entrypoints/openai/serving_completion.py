"""POST /v1/completions: prompts (text, token ids, or lists of them) -> text, streamed or not."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.serving_base import (
    APIError,
    ClosingStreamingResponse,
    ServingContext,
    bad_request,
    merge_streams,
    run_until_disconnect,
    set_log_info,
    sse,
    stop_holdback,
)
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import RequestOutput

logger = logging.getLogger("pagedllm.api")

# A logprob JSON cannot carry (-inf): report it as vLLM does.
_MIN_LOGPROB = -9999.0


def finite(value: float | None) -> float | None:
    if value is None:
        return None
    return value if math.isfinite(value) else _MIN_LOGPROB


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts, one list entry each."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty: give a string, a list of strings or token ids.", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def completion_logprobs(
    ctx: ServingContext, token_ids: list[int], logprobs: list[dict[int, float]], text_offset: int
) -> CompletionLogProbs:
    """OpenAI's legacy logprobs: the chosen tokens, their logprobs, the top ones, text offsets."""
    result = CompletionLogProbs()
    for token_id, top in zip(token_ids, logprobs):
        text = ctx.token_text(token_id)
        result.tokens.append(text)
        result.token_logprobs.append(finite(top.get(token_id)))
        ranked: dict[str, float] = {}
        for candidate, value in sorted(top.items(), key=lambda item: item[1], reverse=True):
            # Tokens with the same text (byte pieces all read "\ufffd") share a key: keep the likelier.
            ranked.setdefault(ctx.token_text(candidate), finite(value))  # type: ignore[arg-type]
        result.top_logprobs.append(ranked)
        result.text_offset.append(text_offset)
        text_offset += len(text)
    return result


class OpenAIServingCompletion:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _encode(self, prompts: list[str | list[int]]) -> list[tuple[str | None, list[int]]]:
        """On the engine thread: tokenize text prompts exactly as the engine would."""
        tokenizer = self.ctx.tokenizer
        encoded: list[tuple[str | None, list[int]]] = []
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                try:
                    token_ids = tokenizer.encode(prompt) if prompt else []
                except Exception as exc:  # the tokenizer's own error text means nothing to a client
                    logger.warning("tokenizing prompt %d failed", index, exc_info=exc)
                    message = f"prompt {index} could not be tokenized; send plain UTF-8 text."
                    raise bad_request(message, "prompt") from exc
                encoded.append((prompt, token_ids))
            else:
                encoded.append((None, list(prompt)))
        return encoded

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        ctx.check_model(request.model)
        ctx.async_engine.check_alive()
        if request.suffix:
            raise bad_request("suffix is not supported.", "suffix")
        if request.logit_bias:
            raise bad_request("logit_bias is not supported.", "logit_bias")
        if request.echo and request.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported (no prompt logprobs).", "echo")
        if request.stream and request.best_of is not None and request.best_of != request.n:
            raise bad_request("best_of must equal n (or be left out) when streaming.", "best_of")
        if request.stream and request.use_beam_search:
            raise bad_request("Beam search cannot stream; set stream to false.", "use_beam_search")
        prompts = prompt_list(request.prompt)
        if len(prompts) > ctx.max_prompts_per_request:
            raise bad_request(
                f"prompt holds {len(prompts)} prompts; this server takes at most {ctx.max_prompts_per_request} per "
                "request (--max-prompts-per-request). Split them over several requests.", "prompt"
            )
        params = ctx.make_sampling_params(request, request.max_tokens, request.logprobs)
        encoded = await ctx.async_engine.run_in_engine_thread(self._encode, prompts)
        for _, token_ids in encoded:
            ctx.check_length(len(token_ids), request.max_tokens, "prompt")
        request_id = random_id("cmpl")
        request_ids = [f"{request_id}-{i}" for i in range(len(encoded))]
        engine_prompts: list[Any] = [
            {"prompt_token_ids": ids, "prompt": text} if text is not None else ids for text, ids in encoded
        ]
        set_log_info(raw_request, id=request_id)
        await ctx.add_requests(request_ids, engine_prompts, params)
        streams = [ctx.async_engine.stream_outputs(rid) for rid in request_ids]
        if request.stream:
            return ClosingStreamingResponse(
                self._stream(request, raw_request, request_id, params, streams),
                on_close=lambda: ctx.abort_unfinished(request_ids),
            )

        async def collect() -> list[RequestOutput]:
            finals: list[RequestOutput | None] = [None] * len(streams)
            try:
                async for index, output in merge_streams(streams):
                    finals[index] = output
            finally:
                ctx.abort_unfinished(request_ids)
            return finals  # type: ignore[return-value]

        try:
            finals = await run_until_disconnect(raw_request, collect(), lambda: ctx.abort_unfinished(request_ids))
        except Exception as exc:
            raise ctx.engine_error(exc) from exc
        if finals is None:  # the client is gone; nobody reads this
            return Response(status_code=499)
        response = self._response(request, request_id, finals)
        if response.usage is not None:
            set_log_info(raw_request, prompt_tokens=response.usage.prompt_tokens,
                         completion_tokens=response.usage.completion_tokens)
        return JSONResponse(response.model_dump())

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.ctx.tokenizer.decode(output.prompt_token_ids)

    def _response(self, request: CompletionRequest, request_id: str, finals: list[RequestOutput]) -> CompletionResponse:
        ctx = self.ctx
        choices: list[CompletionResponseChoice] = []
        num_prompt_tokens = num_generated_tokens = 0
        for prompt_index, output in enumerate(finals):
            num_prompt_tokens += len(output.prompt_token_ids)
            prefix = self._prompt_text(output) if request.echo else ""
            for completion in output.outputs:
                num_generated_tokens += len(completion.token_ids)
                logprobs = None
                if request.logprobs is not None and completion.logprobs is not None:
                    logprobs = completion_logprobs(ctx, completion.token_ids, completion.logprobs, len(prefix))
                choices.append(
                    CompletionResponseChoice(
                        index=prompt_index * request.n + completion.index,
                        text=prefix + completion.text,
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                )
        return CompletionResponse(
            id=request_id,
            model=ctx.model_name,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=num_prompt_tokens,
                completion_tokens=num_generated_tokens,
                total_tokens=num_prompt_tokens + num_generated_tokens,
            ),
        )

    async def _stream(
        self,
        request: CompletionRequest,
        raw_request: Request,
        request_id: str,
        params: SamplingParams,
        streams: list[Any],
    ) -> AsyncGenerator[str, None]:
        ctx = self.ctx
        created = int(time.time())
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        sent_chars: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        text_offsets: dict[int, int] = {}
        finished: set[int] = set()
        prompt_tokens: dict[int, int] = {}
        generated_tokens: dict[int, int] = {}
        try:
            async for prompt_index, output in merge_streams(streams):
                prompt_tokens[prompt_index] = len(output.prompt_token_ids)
                for completion in output.outputs:
                    index = prompt_index * request.n + completion.index
                    if index in finished:
                        continue
                    done = completion.finish_reason is not None
                    text = completion.text
                    start = sent_chars.get(index, 0)
                    end = len(text) if done else len(text) - stop_holdback(text, params.stop_strings)
                    end = max(end, start)
                    new_token_ids = completion.token_ids[sent_tokens.get(index, 0) :]
                    prefix = ""
                    if request.echo and index not in sent_chars:
                        prefix = self._prompt_text(output)
                    want_logprobs = request.logprobs is not None and completion.logprobs is not None
                    if end == start and not done and not prefix and not (want_logprobs and new_token_ids):
                        continue
                    logprobs = None
                    if want_logprobs:
                        first = len(completion.token_ids) - len(new_token_ids)
                        offset = text_offsets.get(index, len(prefix))
                        logprobs = completion_logprobs(
                            ctx, new_token_ids, completion.logprobs[first:], offset  # type: ignore[index]
                        )
                        text_offsets[index] = offset + sum(len(t) for t in logprobs.tokens)
                        logprobs = logprobs.model_dump()
                    chunk: dict[str, Any] = {
                        "id": request_id,
                        "object": "text_completion",
                        "created": created,
                        "model": ctx.model_name,
                        "choices": [
                            {
                                "index": index,
                                "text": prefix + text[start:end],
                                "logprobs": logprobs,
                                "finish_reason": completion.finish_reason if done else None,
                                "stop_reason": completion.stop_reason if done else None,
                            }
                        ],
                    }
                    if include_usage:
                        chunk["usage"] = None
                    yield sse(chunk)
                    sent_chars[index] = end
                    sent_tokens[index] = len(completion.token_ids)
                    generated_tokens[index] = len(completion.token_ids)
                    if done:
                        finished.add(index)
            num_prompt = sum(prompt_tokens.values())
            num_generated = sum(generated_tokens.values())
            set_log_info(raw_request, prompt_tokens=num_prompt, completion_tokens=num_generated)
            if include_usage:
                usage = UsageInfo(
                    prompt_tokens=num_prompt, completion_tokens=num_generated, total_tokens=num_prompt + num_generated
                )
                yield sse(
                    {
                        "id": request_id,
                        "object": "text_completion",
                        "created": created,
                        "model": ctx.model_name,
                        "choices": [],
                        "usage": usage.model_dump(),
                    }
                )
        except GeneratorExit:
            set_log_info(raw_request, disconnected=True)
            raise
        except Exception as exc:  # noqa: BLE001 - the status line is sent: report in the stream
            error: APIError = ctx.engine_error(exc)
            set_log_info(raw_request, error=error.message[:200], error_status=error.status_code)
            yield sse(error.body())
        yield sse("[DONE]")
