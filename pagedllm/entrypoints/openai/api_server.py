"""The OpenAI-compatible HTTP server: FastAPI app factory, guard middleware, uvicorn runner.

    pagedllm serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--served-model-name NAME] ...
    python -m pagedllm.entrypoints.openai.api_server [same flags]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import pagedllm
from pagedllm.config import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.entrypoints.llm import render_chat
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_base import APIError, ServingContext, bad_request
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat, conversation
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion

logger = logging.getLogger("pagedllm.api")

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Paths anyone may call even when an API key is set (probes and scrapers).
_OPEN_PATHS = {"/health", "/metrics", "/version", "/ping"}


class GuardMiddleware:
    """Before the app: API key (constant time) and body size limit; after it: one log line per request.

    The body is read here, up to the limit, and replayed to the app: a body over the limit gets a
    413 however it is sent (with a Content-Length or chunked).
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_request_bytes: int, log_requests: bool = True) -> None:
        self.app = app
        self.expected_auth = f"Bearer {api_key}".encode() if api_key else None
        self.max_request_bytes = max_request_bytes
        self.log_requests = log_requests

    def _authorized(self, scope: Scope) -> bool:
        if self.expected_auth is None or scope["path"] in _OPEN_PATHS or scope["method"] == "OPTIONS":
            return True
        provided = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                provided = value
                break
        return hmac.compare_digest(provided, self.expected_auth)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        state: dict[str, Any] = {"status": None, "logged": False}
        log_info = scope.setdefault("pagedllm.log", {})

        def write_log() -> None:
            if state["logged"] or not self.log_requests:
                return
            state["logged"] = True
            client = scope.get("client")
            where = f"{client[0]}:{client[1]}" if client else "-"
            extras = " ".join(f"{k}={v}" for k, v in log_info.items())
            logger.info(
                '%s "%s %s" %s %.3fs %s', where, scope["method"], scope["path"], state["status"] or "-",
                time.perf_counter() - start, extras,
            )

        async def send_and_log(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                write_log()

        try:
            if not self._authorized(scope):
                error = APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send_and_log)
                return
            body_receive = await self._read_body(scope, receive, send_and_log)
            if body_receive is None:
                return
            await self.app(scope, body_receive, send_and_log)
        finally:
            if state["status"] is None:
                log_info.setdefault("disconnected", True)
            write_log()

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """Buffer the body (at most max_request_bytes) and return a receive that replays it; None if answered."""
        too_large = APIError(
            413, f"The request body is larger than the server's limit of {self.max_request_bytes} bytes.",
            code="request_too_large",
        )
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await bad_request("Invalid Content-Length header.").response()(scope, receive, send)
                    return None
                if declared > self.max_request_bytes:
                    await too_large.response()(scope, receive, send)
                    return None
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_request_bytes:
                await too_large.response()(scope, receive, send)
                return None
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return replay


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request body.", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"The request body is not valid JSON: {detail}".rstrip(": "), None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # A union (prompt, stop, content) reports one error per member: name the field, not the member.
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{where}: {first.get('msg', 'invalid value')}{more}", param


def build_app(
    engine_args: EngineArgs | None = None,
    served_model_name: str | list[str] | None = None,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    engine: Any | None = None,
    log_requests: bool = True,
) -> FastAPI:
    """The FastAPI app serving one engine (built here from engine_args unless ``engine`` is given).

    The engine loop starts with the app's lifespan and stops with it; a shutdown fails the
    requests in flight with an error.
    """
    if engine is None:
        from pagedllm.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(engine_args or EngineArgs())
    if isinstance(served_model_name, str):
        names = [served_model_name]
    elif served_model_name:
        names = list(served_model_name)
    else:
        model = engine_args.model if engine_args is not None else None
        names = [model if model else DEFAULT_MODEL_NAME]
    metrics = ServerMetrics(names[0])
    async_engine = AsyncLLMEngine(engine, output_observer=metrics.observe_output)
    metrics.requests_in_flight = lambda: async_engine.num_requests_in_flight
    model_config = engine.model_config
    ctx = ServingContext(
        async_engine=async_engine,
        served_model_names=names,
        model_path=str(model_config.model),
        max_model_len=int(model_config.max_model_len),
        max_num_seqs=int(engine.scheduler_config.max_num_seqs),
        vocab_size=int(model_config.hf_config.vocab_size),
        tokenizer=engine.tokenizer,
    )
    completions = OpenAIServingCompletion(ctx)
    chats = OpenAIServingChat(ctx)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.shutdown()

    app = FastAPI(
        title="pagedllm OpenAI-compatible API", version=pagedllm.__version__, lifespan=lifespan,
        docs_url="/docs", redoc_url=None,
    )
    app.state.async_engine = async_engine
    app.state.serving_context = ctx
    app.state.metrics = metrics
    app.add_middleware(GuardMiddleware, api_key=api_key, max_request_bytes=max_request_bytes,
                       log_requests=log_requests)

    @app.exception_handler(APIError)
    async def api_error_handler(request: Request, exc: APIError) -> JSONResponse:
        request.scope.setdefault("pagedllm.log", {})["error"] = repr(exc.message[:120])
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return await api_error_handler(request, bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(exc.status_code, str(exc.detail))
        return await api_error_handler(request, error)

    @app.exception_handler(EngineDeadError)
    async def engine_dead_handler(request: Request, exc: EngineDeadError) -> JSONResponse:
        return await api_error_handler(request, ctx.engine_error(exc))

    @app.exception_handler(Exception)
    async def unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return APIError(500, f"Internal server error: {type(exc).__name__}", err_type="server_error").response()

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_healthy:
            reason = async_engine.dead_error
            message = f"The engine loop has failed: {reason}" if reason is not None else "The server is shutting down."
            return APIError(503, message, code="unhealthy").response()
        return JSONResponse({"status": "ok"})

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": pagedllm.__version__})

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        cards = [ModelCard(id=name, root=ctx.model_path, max_model_len=ctx.max_model_len) for name in names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/metrics")
    async def get_metrics() -> Response:
        if async_engine.is_healthy:
            with contextlib.suppress(Exception):
                metrics.update_stats(await asyncio.wait_for(async_engine.get_stats(), timeout=10))
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(request: TokenizeRequest) -> JSONResponse:
        ctx.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("Give exactly one of prompt (text) or messages (a chat).", "prompt")

        def encode() -> list[int]:
            if request.prompt is not None:
                return list(ctx.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens))
            return render_chat(ctx.tokenizer, conversation(request.messages or []), None,
                               request.add_generation_prompt)[1]

        try:
            token_ids = await async_engine.run_in_engine_thread(encode)
        except APIError:
            raise
        except Exception as exc:  # template errors and the like: the input is at fault
            raise bad_request(str(exc), "messages" if request.messages is not None else "prompt") from exc
        body = TokenizeResponse(count=len(token_ids), max_model_len=ctx.max_model_len, tokens=token_ids)
        return JSONResponse(body.model_dump())

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        ctx.check_model(request.model)
        bad = [t for t in request.tokens if not 0 <= t < ctx.vocab_size]
        if bad:
            raise bad_request(f"Token id {bad[0]} is out of the vocabulary range [0, {ctx.vocab_size}).", "tokens")
        text = await async_engine.run_in_engine_thread(ctx.tokenizer.decode, request.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chats.create_chat_completion(request, raw_request)

    return app


class _Server(uvicorn.Server):
    """uvicorn's server, failing the requests in flight first when it stops (SIGINT/SIGTERM).

    Without that, uvicorn's graceful shutdown would wait for every open stream to finish.
    """

    def __init__(self, config: uvicorn.Config, async_engine: AsyncLLMEngine) -> None:
        super().__init__(config)
        self.async_engine = async_engine

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        self.async_engine.fail_all_requests("The server is shutting down.")
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the captured signal after shutting down (a KeyboardInterrupt traceback on
        # Ctrl-C, death by SIGTERM): the shutdown was clean, so exit normally instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def run_server(args: argparse.Namespace) -> None:
    """Build the engine from parsed CLI flags and serve until SIGINT/SIGTERM."""
    from pagedllm.entrypoints.engine_flags import engine_args_from_cli

    log_level = str(getattr(args, "log_level", "info")).upper()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedllm").setLevel(log_level)
    engine_args = engine_args_from_cli(args)
    api_key = args.api_key or os.environ.get("PAGEDLLM_API_KEY") or None
    app = build_app(
        engine_args,
        served_model_name=args.served_model_name,
        api_key=api_key,
        max_request_bytes=args.max_request_bytes,
        log_requests=not getattr(args, "disable_log_requests", False),
    )
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("Listening on %s: reachable from other machines%s", args.host,
                       "" if api_key else " and no --api-key is set")
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=log_level.lower(),
        access_log=False,  # GuardMiddleware writes one line per request
        timeout_graceful_shutdown=getattr(args, "shutdown_timeout", 10),
        timeout_keep_alive=5,
    )
    server = _Server(config, app.state.async_engine)
    logger.info("Serving %s on http://%s:%d", args.served_model_name or engine_args.model or DEFAULT_MODEL_NAME,
                args.host, args.port)
    server.run()


def main(argv: list[str] | None = None) -> None:
    from pagedllm.entrypoints.serve_cli import add_server_args

    parser = argparse.ArgumentParser(prog="python -m pagedllm.entrypoints.openai.api_server",
                                     description="pagedllm OpenAI-compatible server")
    add_server_args(parser, model_positional=False)
    run_server(parser.parse_args(argv))


if __name__ == "__main__":
    main()
