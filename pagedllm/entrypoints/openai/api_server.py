"""The OpenAI-compatible HTTP server: the FastAPI app factory and the uvicorn runner.

The command line lives in pagedllm/entrypoints/serve_cli.py (``pagedllm serve``), which gathers
ServerSettings and calls run_server; the routes live in router.py.
"""

from __future__ import annotations

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
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.config import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.engine.engine_client import EngineClient
from pagedllm.entrypoints.chat_utils import load_chat_template
from pagedllm.entrypoints.dashboard import install_dashboard
from pagedllm.entrypoints.openai.defaults import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_RESPONSES_STORE_BYTES,
    DEFAULT_RESPONSES_STORE_SIZE,
    DEFAULT_TIMEOUT_BODY,
)
from pagedllm.entrypoints.openai.guard import GuardMiddleware
from pagedllm.entrypoints.openai.http_limits import PortInUseError, bind_socket, is_serving_rank, server_config
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagedllm.entrypoints.openai.response_store import ResponseStore
from pagedllm.entrypoints.openai.router import router
from pagedllm.entrypoints.openai.serving_base import APIError, ServingContext, bad_request, server_tokenizer
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.settings import ServerSettings
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.entrypoints.template_sandbox import DEFAULT_MAX_CHARS as DEFAULT_TEMPLATE_MAX_CHARS
from pagedllm.entrypoints.template_sandbox import TemplateLimits
from pagedllm.serving.data_parallel import DataParallelConfig

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
    chat_template: str | None = None,
    response_role: str = "assistant",
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    data_parallel: DataParallelConfig | None = None,
    reasoning_parser: str | None = None,
    responses_store_size: int = DEFAULT_RESPONSES_STORE_SIZE,
    trust_request_chat_template: bool = False,
    responses_store_max_bytes: int = DEFAULT_RESPONSES_STORE_BYTES,
) -> FastAPI:
    """The FastAPI app serving one engine (built here from engine_args, on the engine's own thread,
    unless ``engine`` is given).

    The engine loop starts with the app's lifespan and stops with it; a shutdown fails the
    requests in flight with an error. ``on_engine_dead`` is called once if the engine fails for
    good (run_server ends the process there); without it the app stays up and answers 503/500.
    ``chat_template``: a file or the template text, used instead of the tokenizer's.
    ``data_parallel``: engine replicas on Ray behind this app (serving/replica_frontend.py)
    instead of one engine here, when it asks for them.
    ``responses_store_size``, ``responses_store_max_bytes``: how many stored /v1/responses are kept in
    memory (an LRU), and how large they may be in all.
    ``trust_request_chat_template``: render a request's own chat_template (else it is a 400).
    """
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser.")
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got {tool_call_parser!r}.")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {sorted(REASONING_PARSERS)}, got {reasoning_parser!r}.")
    template = load_chat_template(chat_template)
    # Before the engine: a bad size fails fast.
    response_store = ResponseStore(responses_store_size, responses_store_max_bytes)
    if isinstance(served_model_name, str):
        names = [served_model_name]
    elif served_model_name:
        names = list(served_model_name)
    else:
        model = engine_args.model if engine_args is not None else None
        names = [model if model else DEFAULT_MODEL_NAME]
    metrics = ServerMetrics(names[0])
    if engine is None and data_parallel is not None and data_parallel.uses_replicas:
        from pagedllm.serving.replica_frontend import ReplicatedEngine

        async_engine = ReplicatedEngine.from_engine_args(
            engine_args or EngineArgs(), data_parallel, output_observer=metrics.observe_output, on_dead=on_engine_dead
        )
        engine = async_engine.engine
    elif engine is None:
        async_engine = AsyncLLMEngine.from_engine_args(
            engine_args or EngineArgs(), output_observer=metrics.observe_output, on_dead=on_engine_dead
        )
        engine = async_engine.engine
    else:
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
        tokenizer=server_tokenizer(engine.tokenizer),
        max_prompts_per_request=max_prompts_per_request,
        structured=getattr(engine, "structured_outputs", None),
        hf_config=model_config.hf_config,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.shutdown()
            ctx.close()

    app = FastAPI(
        title="pagedllm OpenAI-compatible API", version=pagedllm.__version__, lifespan=lifespan,
        docs_url="/docs", redoc_url=None,
    )
    app.state.async_engine = async_engine
    app.state.serving_context = ctx
    app.state.metrics = metrics
    app.state.serving_completion = OpenAIServingCompletion(ctx)
    parser = TOOL_PARSERS[tool_call_parser]() if tool_call_parser is not None else None
    app.state.serving_chat = OpenAIServingChat(
        ctx, template, response_role, parser, enable_auto_tool_choice,
        reasoning_parser=REASONING_PARSERS[reasoning_parser] if reasoning_parser is not None else None,
        trust_request_chat_template=trust_request_chat_template,
        # A rendered prompt may hold the whole body a few times over; a larger --max-request-bytes allows more.
        template_limits=TemplateLimits(max_chars=max(DEFAULT_TEMPLATE_MAX_CHARS, 4 * max_request_bytes)),
    )
    app.state.serving_responses = OpenAIServingResponses(app.state.serving_chat, response_store)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_request_bytes=max_request_bytes,
                       log_requests=log_requests, timeout_body=timeout_body)
    install_dashboard(app, async_engine, names[0])  # after the guard: its ?key= handling must run first
    _install_error_handlers(app, ctx)
    app.include_router(router)
    return app


def _install_error_handlers(app: FastAPI, ctx: ServingContext) -> None:
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


class _Server(uvicorn.Server):
    """uvicorn's server, failing the requests in flight first when it stops (SIGINT/SIGTERM).

    Without that, uvicorn's graceful shutdown would wait for every open stream to finish.
    """

    def __init__(self, config: uvicorn.Config, async_engine: EngineClient) -> None:
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


def run_server(settings: ServerSettings, sock: socket.socket | None = None) -> None:
    """Bind the port (unless ``sock`` is bound already), build the engine, serve until SIGINT/SIGTERM.

    Exits 1 if the port cannot be bound (before the model loads) and 1 if the engine fails for
    good: the requests in flight are answered with an error, then the process ends so that a
    supervisor restarts it (as vLLM does).
    """
    log_level = settings.log_level.upper()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedllm").setLevel(log_level)
    if sock is None and is_serving_rank():  # torchrun's other ranks only compute (they never serve)
        try:
            sock = bind_socket(settings.host, settings.port)
        except PortInUseError as exc:
            logger.error("%s", exc)
            raise SystemExit(1) from None
    if sock is not None:
        logger.info("Listening on http://%s:%d; loading the model", settings.host, settings.port)
    engine_args = settings.engine_args
    api_key = settings.api_key or os.environ.get("PAGEDLLM_API_KEY") or None
    servers: list[_Server] = []

    def on_engine_dead(exc: BaseException) -> None:
        logger.critical("The engine failed; answering the requests in flight with an error and exiting (code 1) "
                        "so that a supervisor restarts the server.")
        for server in servers:
            server.should_exit = True
        # Should the graceful shutdown hang, end the process anyway: a dead engine must not stay up.
        backstop = threading.Timer(settings.shutdown_timeout + 5.0, os._exit, args=(1,))
        backstop.daemon = True
        backstop.start()

    try:
        app = build_app(
            engine_args,
            served_model_name=settings.served_model_name,
            api_key=api_key,
            max_request_bytes=settings.max_request_bytes,
            log_requests=settings.log_requests,
            timeout_body=settings.timeout_body,
            max_prompts_per_request=settings.max_prompts_per_request,
            on_engine_dead=on_engine_dead,
            chat_template=settings.chat_template,
            response_role=settings.response_role,
            tool_call_parser=settings.tool_call_parser,
            enable_auto_tool_choice=settings.enable_auto_tool_choice,
            data_parallel=settings.data_parallel,
            reasoning_parser=settings.reasoning_parser,
            responses_store_size=settings.responses_store_size,
            trust_request_chat_template=settings.trust_request_chat_template,
            responses_store_max_bytes=settings.responses_store_max_bytes,
        )
    except ValueError as exc:  # a setting that cannot work: say which, exit 2 as argparse does
        logger.error("%s", exc)
        raise SystemExit(2) from None
    if settings.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("Listening on %s: reachable from other machines%s", settings.host,
                       "" if api_key else " and no --api-key is set")
    config = server_config(
        app,
        timeout_keep_alive=settings.timeout_keep_alive,
        timeout_headers=settings.timeout_headers,
        limit_concurrency=settings.limit_concurrency,
        log_level=log_level.lower(),
        access_log=False,  # GuardMiddleware writes one line per request
        timeout_graceful_shutdown=int(settings.shutdown_timeout),
        root_path=settings.root_path,  # uvicorn sets the ASGI root_path the app's routes and docs use
    )
    server = _Server(config, app.state.async_engine)
    servers.append(server)
    name = (settings.served_model_name or [engine_args.model or DEFAULT_MODEL_NAME])[0]
    logger.info("Serving %s on http://%s:%d; layers: %s", name, settings.host, settings.port,
                app.state.async_engine.engine.layer_placement)
    server.run(sockets=[sock] if sock is not None else None)
    if app.state.async_engine.dead_error is not None:
        raise SystemExit(1)
