"""The OpenAI-compatible HTTP server: FastAPI app factory and the uvicorn runner.

    pagedllm serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--served-model-name NAME] ...
    python -m pagedllm.entrypoints.openai.api_server [same flags]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.config import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.entrypoints.dashboard import install_dashboard
from pagedllm.entrypoints.openai.defaults import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_TIMEOUT_BODY,
)
from pagedllm.entrypoints.openai.guard import GuardMiddleware
from pagedllm.entrypoints.openai.http_limits import PortInUseError, bind_socket, is_serving_rank, server_config
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
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat, conversation, render_chat_checked
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion

logger = logging.getLogger("pagedllm.api")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# What each union-typed field accepts, for a 400 that says so (pydantic reports each member apart).
_ACCEPTED_FORMS = {
    "prompt": "a string, a list of strings, a list of token ids (integers, not booleans) or a list of such lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request body.", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"The request body is not valid JSON: {detail}".rstrip(": "), None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    others = len(errors) - 1
    # A union (prompt, stop, content) reports one error per member: name the field and what it takes.
    union_field = next((name for name in reversed(loc) if name in _ACCEPTED_FORMS), None)
    if union_field is not None and "surrogate" not in message:
        loc = loc[: loc.index(union_field) + 1]
        same_field = [e for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][: len(loc)] == loc]
        if len(same_field) > 1:
            message = f"must be {_ACCEPTED_FORMS[union_field]}"
            others = len(errors) - len(same_field)
    where = ".".join(loc) if loc else "body"
    more = f" (and {others} more problem(s))" if others else ""
    return f"{where}: {message}{more}", param


def build_app(
    engine_args: EngineArgs | None = None,
    served_model_name: str | list[str] | None = None,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    engine: Any | None = None,
    log_requests: bool = True,
    timeout_body: float = DEFAULT_TIMEOUT_BODY,
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
    on_engine_dead: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The FastAPI app serving one engine (built here from engine_args unless ``engine`` is given).

    The engine loop starts with the app's lifespan and stops with it; a shutdown fails the
    requests in flight with an error. ``on_engine_dead`` is called once if the engine fails for
    good (run_server ends the process there); without it the app stays up and answers 503/500.
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
    async_engine = AsyncLLMEngine(engine, output_observer=metrics.observe_output, on_dead=on_engine_dead)
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
        max_prompts_per_request=max_prompts_per_request,
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
                       log_requests=log_requests, timeout_body=timeout_body)
    install_dashboard(app, async_engine, names[0])  # after the guard: its ?key= handling must run first

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
        return APIError(500, "Internal server error; the server log has the details.",
                        err_type="server_error").response()

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_healthy:
            if async_engine.dead_error is not None:
                message = "The engine has failed; the server is shutting down to be restarted."
            else:
                message = "The server is shutting down."
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
                try:
                    return list(ctx.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens))
                except Exception as exc:  # the tokenizer's error text means nothing to a client
                    logger.warning("tokenizing failed", exc_info=exc)
                    raise bad_request("prompt could not be tokenized; send plain UTF-8 text.", "prompt") from exc
            return render_chat_checked(ctx.tokenizer, conversation(request.messages or []),
                                       request.add_generation_prompt)[1]

        try:
            token_ids = await async_engine.run_in_engine_thread(encode)
        except ValueError as exc:  # render_chat_checked's messages say what to change
            raise bad_request(str(exc), "messages") from exc
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


def run_server(args: argparse.Namespace, sock: socket.socket | None = None) -> None:
    """Bind the port (unless ``sock`` is bound already), build the engine from parsed CLI flags,
    serve until SIGINT/SIGTERM.

    Exits 1 if the port cannot be bound (before the model loads) and 1 if the engine fails for
    good: the requests in flight are answered with an error, then the process ends so that a
    supervisor restarts it (as vLLM does).
    """
    from pagedllm.entrypoints.engine_flags import engine_args_from_cli

    log_level = str(getattr(args, "log_level", "info")).upper()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedllm").setLevel(log_level)
    if sock is None and is_serving_rank():  # torchrun's other ranks only compute (they never serve)
        try:
            sock = bind_socket(args.host, args.port)
        except PortInUseError as exc:
            logger.error("%s", exc)
            raise SystemExit(1) from None
    if sock is not None:
        logger.info("Listening on http://%s:%d; loading the model", args.host, args.port)
    engine_args = engine_args_from_cli(args)
    api_key = args.api_key or os.environ.get("PAGEDLLM_API_KEY") or None
    shutdown_timeout = float(getattr(args, "shutdown_timeout", 10))
    servers: list[_Server] = []

    def on_engine_dead(exc: BaseException) -> None:
        logger.critical("The engine failed; answering the requests in flight with an error and exiting (code 1) "
                        "so that a supervisor restarts the server.")
        for server in servers:
            server.should_exit = True
        # Should the graceful shutdown hang, end the process anyway: a dead engine must not stay up.
        backstop = threading.Timer(shutdown_timeout + 5.0, os._exit, args=(1,))
        backstop.daemon = True
        backstop.start()

    app = build_app(
        engine_args,
        served_model_name=args.served_model_name,
        api_key=api_key,
        max_request_bytes=args.max_request_bytes,
        log_requests=not getattr(args, "disable_log_requests", False),
        timeout_body=args.timeout_body,
        max_prompts_per_request=args.max_prompts_per_request,
        on_engine_dead=on_engine_dead,
    )
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("Listening on %s: reachable from other machines%s", args.host,
                       "" if api_key else " and no --api-key is set")
    config = server_config(
        app,
        timeout_keep_alive=args.timeout_keep_alive,
        timeout_headers=args.timeout_headers,
        limit_concurrency=args.limit_concurrency,
        log_level=log_level.lower(),
        access_log=False,  # GuardMiddleware writes one line per request
        timeout_graceful_shutdown=int(shutdown_timeout),
    )
    server = _Server(config, app.state.async_engine)
    servers.append(server)
    logger.info("Serving %s on http://%s:%d", args.served_model_name or engine_args.model or DEFAULT_MODEL_NAME,
                args.host, args.port)
    server.run(sockets=[sock] if sock is not None else None)
    if app.state.async_engine.dead_error is not None:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    from pagedllm.entrypoints.serve_cli import add_server_args

    parser = argparse.ArgumentParser(prog="python -m pagedllm.entrypoints.openai.api_server",
                                     description="pagedllm OpenAI-compatible server")
    add_server_args(parser, model_positional=False)
    run_server(parser.parse_args(argv))


if __name__ == "__main__":
    main()
