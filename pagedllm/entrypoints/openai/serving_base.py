"""What the completion and chat handlers share: errors, model check, sampling params, request I/O."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedllm.engine.async_engine import (
    EngineDeadError,
    RequestAbortedError,
    RequestFailedError,
    RequestRejectedError,
)
from pagedllm.engine.engine_client import EngineClient
from pagedllm.engine.request import EngineRequest
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.sequence import RequestOutput
from pagedllm.structured import StructuredOutputManager

logger = logging.getLogger("pagedllm.api")

T = TypeVar("T")

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered as OpenAI does: status code and {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | int | None = None,
        err_type: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or _STATUS_TYPES.get(status_code, "invalid_request_error")
        self.headers = headers or []  # e.g. connection: close after a request we stopped reading

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        response = ErrorJSONResponse(self.body(), status_code=self.status_code)
        response.raw_headers.extend(self.headers)
        return response


class ErrorJSONResponse(JSONResponse):
    """JSON with everything outside ASCII escaped: a message quoting client input always encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


_FIRST_WORD = re.compile(r"^\s*([A-Za-z_]+)")


def param_of(message: str, known: set[str]) -> str | None:
    """The request field a validation message is about ("top_p must be ..." -> "top_p")."""
    match = _FIRST_WORD.match(message)
    return match.group(1) if match and match.group(1) in known else None


def logit_bias(request: Any, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"token id as text": bias}) as {token id: bias}."""
    if not request.logit_bias:
        return None
    result: dict[int, float] = {}
    for key, value in request.logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key[:40]!r}.", "logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"logit_bias: token id {token_id} is out of the vocabulary range [0, {vocab_size}).",
                              "logit_bias")
        result[token_id] = value
    return result


def server_tokenizer(tokenizer: Any) -> Any:
    """The server's own copy of the engine's tokenizer: the server's tokenizer thread and the engine's
    (detokenizing every step) then never share one object, whose Rust side refuses concurrent
    mutable use."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared, as before
        logger.warning("the tokenizer could not be copied; the server shares the engine's")
        return tokenizer


@dataclass
class ServingContext:
    """The server's view of the engine, shared by every handler."""

    async_engine: EngineClient
    served_model_names: list[str]
    model_path: str
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    tokenizer: Any
    max_prompts_per_request: int = 1024
    structured: StructuredOutputManager | None = None
    hf_config: Any = None  # the model's config, for checks that name the served model (not its path)
    _token_text_cache: dict[int, str] = field(default_factory=dict)
    _tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-tokenizer")
    )

    async def run_in_tokenizer_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer work (encoding prompts, rendering chats) on the server's tokenizer thread.

        Beside the engine's step, not on the engine thread: there a request arriving mid-step would be
        tokenized only after that step, and its add would then wait behind the next one (the loop
        queues it the moment a step ends): a whole step more before its first token."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @staticmethod
    def identity(request: Any) -> dict[str, str]:
        """The end-user identifiers a request carries (user, safety_identifier), for its log line."""
        found = {}
        for name in ("user", "safety_identifier"):
            value = getattr(request, name, None)
            if value:
                found[name] = repr(value[:64])
        return found

    def check_model(self, model: str | None) -> None:
        if model is None or model == "" or model in self.served_model_names:
            return
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def make_sampling_params(
        self,
        request: Any,
        max_tokens: int | None,
        logprobs: int | None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """SamplingParams from a request's fields; each bad field a 400 naming it."""
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed with stream set to true.", "stream_options")
        n = request.n
        best_of = request.best_of
        for name, value in (("n", n), ("best_of", best_of)):
            if isinstance(value, int) and value > self.max_num_seqs:
                raise bad_request(
                    f"{name} must be at most {self.max_num_seqs} (the server's max_num_seqs), got {value}.", name
                )
        kwargs: dict[str, Any] = dict(
            n=n,
            best_of=best_of,
            presence_penalty=request.presence_penalty if request.presence_penalty is not None else 0.0,
            frequency_penalty=request.frequency_penalty if request.frequency_penalty is not None else 0.0,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            include_stop_str_in_output=request.include_stop_str_in_output,
            logprobs=logprobs,
            seed=request.seed,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            use_beam_search=request.use_beam_search,
            length_penalty=request.length_penalty,
            prompt_logprobs=request.prompt_logprobs,
            logit_bias=logit_bias(request, self.vocab_size),
            structured_outputs=structured,
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(request, name)
            if value is not None:
                kwargs[name] = value
        if request.use_beam_search and best_of is None:
            kwargs["best_of"] = max(n, 2)
            kwargs["temperature"] = kwargs.get("temperature", 0.0)
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            raise bad_request(str(exc), param_of(str(exc), set(kwargs) | {"stop"})) from exc

    async def compile_grammar(self, spec: StructuredOutputsParams | None, field_name: str | None) -> None:
        """Compile a request's constraint off the engine thread (a large schema takes a while), so a bad
        one is a 400 naming the request's field; the engine then finds it in the grammar cache."""
        if spec is None or self.structured is None:
            return
        try:
            await asyncio.to_thread(self.structured.compiler.compile, spec)
        except InvalidRequestError as exc:
            raise bad_request(f"{field_name}: {exc}", field_name) from exc

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str) -> None:
        """Refuse a prompt (plus requested completion) that cannot fit the context, with both numbers."""
        if num_prompt_tokens >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt is "
                f"{num_prompt_tokens} tokens long, which leaves no room to generate. Please shorten the prompt.",
                prompt_param,
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
                "completion). Please reduce the length of the prompt or the completion.",
                "max_tokens",
            )

    def token_text(self, token_id: int) -> str:
        """The text of one token alone, as logprobs report it."""
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text_cache) < 200_000:
                self._token_text_cache[token_id] = text
        return text

    async def add_requests(
        self,
        request_ids: list[str],
        prompts: list[Any],
        params: SamplingParams,
        prompt_param: str = "prompt",
        priority: int = 0,
        prompt_cache_key: str | None = None,
    ) -> None:
        """Queue every prompt or none: a prompt the engine refuses aborts the ones queued before it.

        ``prompt_cache_key`` reaches the engine front: data-parallel replicas route by it."""
        added: list[str] = []
        try:
            for request_id, prompt in zip(request_ids, prompts):
                await self.async_engine.add(EngineRequest(request_id, prompt, params, priority=priority,
                                                          cache_key=prompt_cache_key))
                added.append(request_id)
        except BaseException as exc:
            for request_id in added:
                self.async_engine.abort(request_id)
            if isinstance(exc, ValueError):
                # The engine's own message (never a tokenizer's: prompts arrive tokenized or checked).
                param = getattr(exc, "param", None)
                raise bad_request(str(exc), prompt_param if param in (None, "prompt") else param) from exc
            raise

    def abort_unfinished(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.async_engine.is_in_flight(request_id):
                self.async_engine.abort(request_id)

    def engine_error(self, exc: BaseException) -> APIError:
        """The API error for an exception out of the engine front."""
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, RequestRejectedError):
            return bad_request(str(exc), "prompt")
        if isinstance(exc, RequestFailedError):  # this request alone; the message names the stage only
            return APIError(500, str(exc), code="request_failed", err_type="server_error")
        if isinstance(exc, RequestAbortedError):
            return APIError(500, str(exc), code="request_aborted", err_type="server_error")
        if isinstance(exc, EngineDeadError) and getattr(exc, "http_status", None) is not None:
            # Replicas on Ray (serving/replica_frontend.py): none live now, or this one failed mid-answer.
            return APIError(exc.http_status, str(exc), code=getattr(exc, "code", None))
        if isinstance(exc, EngineDeadError):
            if self.async_engine.dead_error is None:
                return APIError(503, "The server is shutting down; retry the request.", code="server_shutting_down")
            # The exception is in the server log; the process is on its way out for a restart.
            return APIError(500, "The engine failed and the server is restarting; retry the request shortly.",
                            code="engine_dead", err_type="server_error")
        logger.exception("unexpected error while serving a request", exc_info=exc)
        return APIError(500, "Internal server error; the server log has the details.", err_type="server_error")


def set_log_info(raw_request: Request, **info: Any) -> None:
    """Fields for the request's log line (written by the middleware when the response ends)."""
    log_info = raw_request.scope.setdefault("pagedllm.log", {})
    log_info.update(info)


async def merge_streams(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave several requests' output streams as (stream index, output), as they come."""
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            aclose = getattr(streams[0], "aclose", None)
            if aclose is not None:
                await aclose()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
            await queue.put((index, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


async def listen_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(raw_request: Request, work: Awaitable[T], on_disconnect: Callable[[], None]) -> T | None:
    """Run a non-streaming handler; if the client goes away first, cancel it and call on_disconnect."""
    handler = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(listen_for_disconnect(raw_request))
    try:
        done, _ = await asyncio.wait({handler, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
    if handler in done:
        return handler.result()
    handler.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await handler
    on_disconnect()
    set_log_info(raw_request, disconnected=True)
    return None


def sse(data: Any) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs on_close however it ends (done, client gone, cancelled).

    Starlette cancels the body iterator when the client disconnects; a generator cancelled before
    its first step never runs its finally, so the abort lives here instead.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


def stop_holdback(text: str, stop_strings: list[str]) -> int:
    """How many trailing characters of ``text`` could start a stop string (and must not be streamed yet).

    Only the last ``len(stop) - 1`` characters can start a partial match; in that tail the candidate
    starts are where the stop string's first character occurs (found by str.find, in C), tried
    longest first, so a step costs about one comparison per stop string, not one per prefix length.
    """
    longest = 0
    text_len = len(text)
    for stop in stop_strings:
        window = min(len(stop) - 1, text_len)
        if window <= longest:
            continue
        first = stop[0]
        pos = text.find(first, text_len - window)
        while pos != -1 and text_len - pos > longest:
            if stop.startswith(text[pos:]):
                longest = text_len - pos
                break
            pos = text.find(first, pos + 1)
    return longest
