"""POST /v1/completions: prompts (text, token ids, or lists of them) -> text, streamed or not.

``echo`` puts the prompt in front of the text; with ``logprobs`` the prompt's tokens get their
logprobs too (the first one None), and ``max_tokens: 0`` returns the prompt alone: the
log-likelihood request of lm-evaluation-harness's ``local-completions`` model.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    random_id,
)
from pagedllm.entrypoints.openai.request_fields import refuse_unsupported_completion_fields, structured_outputs
from pagedllm.entrypoints.openai.serving_base import (
    ClosingStreamingResponse,
    ServingContext,
    bad_request,
    set_log_info,
)
from pagedllm.entrypoints.openai.streaming import ChoiceDelta, DeltaTracker, event_stream, final_outputs
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
    ctx: ServingContext, token_ids: list[int], logprobs: list[dict[int, float] | None], text_offset: int
) -> CompletionLogProbs:
    """OpenAI's legacy logprobs: the chosen tokens, their logprobs, the top ones, text offsets.

    An entry of None (a prompt's first token, which nothing predicts) has no logprob and no top.
    """
    result = CompletionLogProbs()
    for token_id, top in zip(token_ids, logprobs):
        text = ctx.token_text(token_id)
        result.tokens.append(text)
        result.text_offset.append(text_offset)
        text_offset += len(text)
        if top is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(finite(top.get(token_id)))
        ranked: dict[str, float] = {}
        for candidate, value in sorted(top.items(), key=lambda item: item[1], reverse=True):
            # Tokens with the same text (byte pieces all read "\ufffd") share a key: keep the likelier.
            ranked.setdefault(ctx.token_text(candidate), finite(value))  # type: ignore[arg-type]
        result.top_logprobs.append(ranked)
    return result


def vllm_prompt_logprobs(
    ctx: ServingContext, token_ids: list[int], logprobs: list[dict[int, float] | None] | None
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's prompt_logprobs shape: per prompt token {token id: {logprob, rank, decoded_token}}.

    The prompt's own token has its rank in the whole vocabulary (1 + the tokens likelier), which the
    engine counted (sampling/logprob_rank.py); the top entries beside it are ranked 1..k.
    """
    if logprobs is None:
        return None
    result: list[dict[str, dict[str, Any]] | None] = []
    for token_id, top in zip(token_ids, logprobs):
        if top is None:
            result.append(None)
            continue
        own = top[token_id]
        entry = {str(token_id): {"logprob": finite(own), "rank": getattr(own, "rank", None),
                                 "decoded_token": ctx.token_text(token_id)}}
        for rank, (candidate, value) in enumerate(sorted(top.items(), key=lambda item: item[1], reverse=True), 1):
            entry.setdefault(str(candidate), {"logprob": finite(value), "rank": getattr(value, "rank", rank),
                                              "decoded_token": ctx.token_text(candidate)})
        result.append(entry)
    return result


@dataclass
class _EchoPlan:
    """What of the prompt a response repeats."""

    echo: bool
    logprobs: int | None  # the request's logprobs (top k per token)
    prompt_only: bool  # max_tokens 0: the prompt alone, the one computed token dropped


class OpenAIServingCompletion:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _encode(self, prompts: list[str | list[int]]) -> list[tuple[str | None, list[int]]]:
        """On the tokenizer thread: tokenize text prompts exactly as the engine would."""
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
        refuse_unsupported_completion_fields(request)
        if request.stream and request.best_of is not None and request.best_of != request.n:
            raise bad_request("best_of must equal n (or be left out) when streaming.", "best_of")
        if request.stream and request.use_beam_search:
            raise bad_request("Beam search cannot stream; set stream to false.", "use_beam_search")
        plan = _EchoPlan(bool(request.echo), request.logprobs, request.max_tokens == 0)
        if plan.prompt_only and not plan.echo:
            raise bad_request("max_tokens must be at least 1 (0 is only allowed with echo, to score the prompt).",
                              "max_tokens")
        prompts = prompt_list(request.prompt)
        if len(prompts) > ctx.max_prompts_per_request:
            raise bad_request(
                f"prompt holds {len(prompts)} prompts; this server takes at most {ctx.max_prompts_per_request} per "
                "request (--max-prompts-per-request). Split them over several requests.", "prompt"
            )
        spec, spec_field = structured_outputs(request)
        # One token is computed for max_tokens 0 (a step always samples) and left out of the response.
        max_tokens = 1 if plan.prompt_only else request.max_tokens
        params = ctx.make_sampling_params(request, max_tokens, request.logprobs, spec)
        if plan.echo and plan.logprobs is not None:
            params.prompt_logprobs = max(params.prompt_logprobs or 0, plan.logprobs)
        await ctx.compile_grammar(spec, spec_field)
        encoded = await ctx.run_in_tokenizer_thread(self._encode, prompts)
        for _, token_ids in encoded:
            ctx.check_length(len(token_ids), max_tokens, "prompt")
        request_id = random_id("cmpl")
        request_ids = [f"{request_id}-{i}" for i in range(len(encoded))]
        engine_prompts: list[Any] = [
            {"prompt_token_ids": ids, "prompt": text} if text is not None else ids for text, ids in encoded
        ]
        set_log_info(raw_request, id=request_id, **ctx.identity(request))
        await ctx.add_requests(request_ids, engine_prompts, params, priority=request.priority)
        streams = [ctx.async_engine.stream_outputs(rid) for rid in request_ids]
        if request.stream:
            return ClosingStreamingResponse(
                self._stream(request, raw_request, request_id, plan, params.stop_strings, streams),
                on_close=lambda: ctx.abort_unfinished(request_ids),
            )
        finals = await final_outputs(ctx, raw_request, request_ids, streams)
        if finals is None:  # the client is gone; nobody reads this
            return Response(status_code=499)
        response = self._response(request, request_id, plan, finals)
        if response.usage is not None:
            set_log_info(raw_request, prompt_tokens=response.usage.prompt_tokens,
                         completion_tokens=response.usage.completion_tokens)
        return JSONResponse(response.model_dump())

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.ctx.tokenizer.decode(output.prompt_token_ids)

    def _echoed(self, plan: _EchoPlan, output: RequestOutput) -> tuple[str, CompletionLogProbs | None]:
        """The prompt's text and, with logprobs, its tokens' logprobs (what echo puts first)."""
        if not plan.echo:
            return "", None
        text = self._prompt_text(output)
        if plan.logprobs is None or output.prompt_logprobs is None:
            return text, None
        return text, completion_logprobs(self.ctx, output.prompt_token_ids, output.prompt_logprobs, 0)

    def _generated(
        self, plan: _EchoPlan, completion: Any, first_token: int, text_offset: int
    ) -> CompletionLogProbs | None:
        if plan.logprobs is None or completion.logprobs is None or plan.prompt_only:
            return None
        return completion_logprobs(self.ctx, completion.token_ids[first_token:], completion.logprobs[first_token:],
                                   text_offset)

    def _response(
        self, request: CompletionRequest, request_id: str, plan: _EchoPlan, finals: list[RequestOutput]
    ) -> CompletionResponse:
        ctx = self.ctx
        tracker = DeltaTracker(request.n, [], count_generated=not plan.prompt_only)
        choices: list[CompletionResponseChoice] = []
        for prompt_index, output in enumerate(finals):
            tracker.deltas(prompt_index, output)
            prefix, prompt_logprobs = self._echoed(plan, output)
            for completion in output.outputs:
                text = "" if plan.prompt_only else completion.text
                logprobs = _joined(prompt_logprobs, self._generated(plan, completion, 0, len(prefix)))
                choices.append(
                    CompletionResponseChoice(
                        index=prompt_index * request.n + completion.index,
                        text=prefix + text,
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        prompt_logprobs=self._prompt_logprobs_field(request, output),
                    )
                )
        return CompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=tracker.usage())

    def _prompt_logprobs_field(self, request: CompletionRequest, output: RequestOutput) -> Any:
        if request.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.ctx, output.prompt_token_ids, output.prompt_logprobs)

    def _stream(
        self,
        request: CompletionRequest,
        raw_request: Request,
        request_id: str,
        plan: _EchoPlan,
        stop_strings: list[str],
        streams: list[Any],
    ):
        ctx = self.ctx
        created = int(time.time())
        text_offsets: dict[int, int] = {}

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return {"id": request_id, "object": "text_completion", "created": created, "model": ctx.model_name,
                    "choices": choices}

        def choice_chunks(delta: ChoiceDelta) -> list[dict[str, Any]]:
            prefix, logprobs = self._echoed(plan, delta.output) if delta.is_first else ("", None)
            text = "" if plan.prompt_only else delta.text
            offset = text_offsets.get(delta.index, len(prefix))
            generated = self._generated(plan, delta.completion, delta.first_token, offset)
            if generated is not None:
                text_offsets[delta.index] = offset + sum(len(t) for t in generated.tokens)
            logprobs = _joined(logprobs, generated)
            if not (text or prefix or delta.finished or (logprobs is not None and logprobs.tokens)):
                return []
            choice = {
                "index": delta.index,
                "text": prefix + text,
                "logprobs": logprobs.model_dump() if logprobs is not None else None,
                "finish_reason": delta.completion.finish_reason if delta.finished else None,
                "stop_reason": delta.completion.stop_reason if delta.finished else None,
            }
            if delta.is_first and request.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs_field(request, delta.output)
            return [choice]

        tracker = DeltaTracker(request.n, stop_strings, count_generated=not plan.prompt_only)
        return event_stream(ctx, raw_request, streams, tracker, chunk, choice_chunks, request.stream_options)


def _joined(first: CompletionLogProbs | None, second: CompletionLogProbs | None) -> CompletionLogProbs | None:
    if first is None or second is None:
        return first or second
    return CompletionLogProbs(
        text_offset=first.text_offset + second.text_offset,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        tokens=first.tokens + second.tokens,
        top_logprobs=first.top_logprobs + second.top_logprobs,
    )
