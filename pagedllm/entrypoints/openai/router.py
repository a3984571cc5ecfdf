"""The server's routes. Each handler finds the serving objects on ``request.app.state`` (build_app puts them there)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import pagedllm
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving_base import APIError, ServingContext, bad_request
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding, require_generation, supported_tasks

logger = logging.getLogger("pagedllm.api")

router = APIRouter()


def _ctx(request: Request) -> ServingContext:
    return request.app.state.serving_context


@router.get("/health")
async def health(request: Request) -> Response:
    async_engine = _ctx(request).async_engine
    replica_health = getattr(async_engine, "replica_health", None)
    if not async_engine.is_healthy:
        if async_engine.dead_error is not None:
            message = "The engine has failed; the server is shutting down to be restarted."
        else:
            message = "The server is shutting down."
        if replica_health is not None and async_engine.dead_error is None and not replica_health()["live_replicas"]:
            # Replicas on Ray, all down for now: Ray restarts them.
            message = f"No engine replica is live (0 of {replica_health()['replicas']}); they are restarting."
        return APIError(503, message, code="unhealthy").response()
    if replica_health is not None:
        return JSONResponse({"status": "ok", **replica_health()})
    return JSONResponse({"status": "ok"})


@router.get("/ping")
async def ping(request: Request) -> Response:
    return await health(request)


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": pagedllm.__version__})


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    ctx = _ctx(request)
    tasks = list(supported_tasks(ctx))
    cards = [ModelCard(id=name, root=ctx.model_path, max_model_len=ctx.max_model_len, supported_tasks=tasks)
             for name in ctx.served_model_names]
    return JSONResponse(ModelList(data=cards).model_dump())


@router.get("/metrics")
async def get_metrics(request: Request) -> Response:
    async_engine = _ctx(request).async_engine
    metrics = request.app.state.metrics
    if async_engine.is_healthy:
        with contextlib.suppress(Exception):
            metrics.update_stats(await asyncio.wait_for(async_engine.get_stats(), timeout=10))
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(request: TokenizeRequest, raw_request: Request) -> JSONResponse:
    ctx = _ctx(raw_request)
    ctx.check_model(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise bad_request("Give exactly one of prompt (text) or messages (a chat).", "prompt")
    chats = raw_request.app.state.serving_chat

    def encode() -> list[int]:
        if request.prompt is not None:
            try:
                return list(ctx.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens))
            except Exception as exc:  # the tokenizer's error text means nothing to a client
                logger.warning("tokenizing failed", exc_info=exc)
                raise bad_request("prompt could not be tokenized; send plain UTF-8 text.", "prompt") from exc
        return chats.render(request)[1]

    try:
        token_ids = await ctx.run_in_tokenizer_thread(encode)
    except ValueError as exc:  # the chat renderer's messages say what to change
        raise bad_request(str(exc), "messages") from exc
    body = TokenizeResponse(count=len(token_ids), max_model_len=ctx.max_model_len, tokens=token_ids)
    return JSONResponse(body.model_dump())


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> JSONResponse:
    ctx = _ctx(raw_request)
    ctx.check_model(request.model)
    bad = [t for t in request.tokens if not 0 <= t < ctx.vocab_size]
    if bad:
        raise bad_request(f"Token id {bad[0]} is out of the vocabulary range [0, {ctx.vocab_size}).", "tokens")
    text = await ctx.run_in_tokenizer_thread(ctx.tokenizer.decode, request.tokens)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    require_generation(_ctx(raw_request))
    return await raw_request.app.state.serving_completion.create_completion(request, raw_request)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    require_generation(_ctx(raw_request))
    return await raw_request.app.state.serving_chat.create_chat_completion(request, raw_request)


@router.post("/v1/embeddings")
async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
    # The handler holds nothing but the serving context, so it is made per request.
    return await OpenAIServingEmbedding(_ctx(raw_request)).create_embedding(request, raw_request)


@router.post("/v1/responses")
async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
    require_generation(_ctx(raw_request))
    return await raw_request.app.state.serving_responses.create_response(request, raw_request)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, raw_request: Request) -> Response:
    if raw_request.query_params.get("stream", "false").lower() not in ("false", "0"):
        raise bad_request("Streaming a stored response again is not supported; leave out stream.", "stream")
    return raw_request.app.state.serving_responses.retrieve(response_id)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, raw_request: Request) -> Response:
    return raw_request.app.state.serving_responses.delete(response_id)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, raw_request: Request) -> Response:
    return raw_request.app.state.serving_responses.cancel(response_id)
