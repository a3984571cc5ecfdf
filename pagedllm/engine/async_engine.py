"""AsyncLLMEngine: the asyncio front of LLMEngine, for the API server and streaming.

LLMEngine is not thread-safe, so every call into it (add, abort, step, stats) runs on ONE worker
thread, a single-thread executor: calls are serialized in submission order and the event loop
never blocks on a step (the server tokenizes prompts on a thread of its own, not this one).
``from_engine_args`` builds the engine on that thread too, so torch runs on one OpenMP team. A
background task drives the engine: while there is work it submits ``step()`` and hands each
RequestOutput to the stream of its request; when there is none it sleeps on an event that
``generate`` and ``abort`` set.

Outputs are cumulative (full text and token ids so far), so a request's stream only keeps the
latest one: a slow reader skips intermediate steps instead of buffering them.

A request whose consumer goes away (client disconnect: the generator is closed or cancelled) is
aborted at the next iteration, which frees its blocks. A request the engine failed on alone (its
output has ``failed``) raises RequestFailedError in its stream; the others run on. An exception
out of ``step`` itself (the forward pass, a worker) fails every request in flight with
EngineDeadError, leaves the engine unhealthy (it is not stepped again) and calls ``on_dead``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from pagedllm.engine.engine_client import EngineClient
from pagedllm.engine.request import EngineRequest
from pagedllm.sequence import RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop failed (or was shut down); no request can run any more."""


class RequestRejectedError(ValueError):
    """The scheduler refused a request after it was queued (RequestOutput.error)."""


class RequestFailedError(RuntimeError):
    """The engine failed while processing this request alone (RequestOutput.failed); others run on."""


class RequestAbortedError(RuntimeError):
    """The request was aborted while a consumer was still reading it."""


@dataclass
class RequestTiming:
    """Times one request saw from the front end (time.time() seconds), for the latency metrics."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generated_tokens: int = 0


# Called on the loop thread for every output a request gets: (output, timing, now, new_tokens).
OutputObserver = Callable[[RequestOutput, RequestTiming, float, int], None]


def record_output(output: Any, timing: RequestTiming, now: float, observer: OutputObserver | None) -> None:
    """Show one output to the observer (with how many tokens it adds), then advance the request's timing."""
    # A pooling request's output (an embedding) carries no generated tokens.
    num_tokens = sum(len(c.token_ids) for c in output.outputs) if isinstance(output, RequestOutput) else 0
    new_tokens = max(num_tokens - timing.num_generated_tokens, 0)
    if observer is not None:
        try:
            observer(output, timing, now, new_tokens)
        except Exception:  # noqa: BLE001 - metrics must never break serving
            logger.exception("output observer failed")
    if new_tokens:
        if timing.first_token_time is None:
            timing.first_token_time = now
        timing.last_token_time = now
        timing.num_generated_tokens = num_tokens


class _RequestStream:
    """The latest output of one request, and an error to raise instead when there is one."""

    def __init__(self, request_id: str, arrival_time: float) -> None:
        self.request_id = request_id
        self.timing = RequestTiming(arrival_time)
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.finished = False

    def put(self, output: RequestOutput) -> None:
        self._latest = output
        if output.finished:
            self.finished = True
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self.finished = True
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        output, self._latest = self._latest, None
        if output is not None:
            # Deliver what was produced before an error; the error comes on the next get().
            if self._error is None:
                self._ready.clear()
            return output
        assert self._error is not None
        raise self._error


def engine_thread() -> ThreadPoolExecutor:
    """The single worker thread an engine runs on."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-engine")


class AsyncLLMEngine(EngineClient):
    """Run an LLMEngine in the background and stream each request's outputs to a coroutine."""

    def __init__(
        self,
        engine: Any,
        output_observer: OutputObserver | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        self.engine = engine
        self.output_observer = output_observer
        # Called on the loop once the engine has failed for good and every request in flight has
        # been failed: the server ends its process there, so a supervisor restarts it.
        self.on_dead = on_dead
        # The one thread every engine call runs on (from_engine_args builds the engine there too).
        self._executor = executor or engine_thread()
        self._streams: dict[str, _RequestStream] = {}
        self._pending_aborts: set[str] = set()
        self._work = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._stopping = False
        self.dead_error: BaseException | None = None

    @classmethod
    def from_engine_args(
        cls,
        engine_args: Any,
        output_observer: OutputObserver | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> AsyncLLMEngine:
        """Build the engine on the thread that will run its steps.

        On a CPU, torch's kernels run on an OpenMP team that belongs to the calling thread. A
        model loaded (and warmed up) on one thread and stepped on another leaves two teams, more
        OpenMP threads than cores, and libgomp then stops spinning between parallel regions and
        puts its workers to sleep: every region pays a wake-up, hundreds per step (here a
        256-token prompt's step 69 ms when built and stepped on one thread, 87-99 ms otherwise).
        """
        from pagedllm.engine.llm_engine import LLMEngine

        executor = engine_thread()
        try:
            engine = executor.submit(LLMEngine.from_engine_args, engine_args).result()
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(engine, output_observer, on_dead, executor=executor)

    # ------------------------------------------------------------------ lifecycle

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and not self._stopping

    def start(self) -> None:
        """Start the background loop on the running event loop (idempotent)."""
        if self.is_running:
            return
        if self.dead_error is not None:
            raise EngineDeadError(f"The engine loop has stopped: {self.dead_error}")
        self._work = asyncio.Event()
        self._loop_task = asyncio.get_running_loop().create_task(self._run_loop(), name="pagedllm-engine-loop")

    def fail_all_requests(self, message: str) -> None:
        """Fail every request in flight (their streams raise EngineDeadError) and refuse new ones."""
        self._stopping = True
        error = EngineDeadError(message)
        for stream in list(self._streams.values()):
            stream.fail(error)
        self._pending_aborts.update(self._streams)
        self._work.set()

    async def shutdown(self) -> None:
        """Fail what is in flight, stop the loop, free the engine's requests, stop the thread."""
        self.fail_all_requests("The server is shutting down.")
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        aborts = list(self._pending_aborts)
        self._pending_aborts.clear()
        if aborts and self.dead_error is None:
            try:
                await self.run_in_engine_thread(self.engine.abort_request, aborts)
            except Exception:  # noqa: BLE001 - best effort while stopping
                logger.exception("abort during shutdown failed")
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ requests

    async def run_in_engine_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the engine's thread, after whatever is already queued there."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"The engine loop has failed and serves no more requests: {self.dead_error}")
        if self._stopping:
            raise EngineDeadError("The server is shutting down.")

    async def add(self, request: EngineRequest) -> None:
        """Queue one request; raises ValueError (nothing queued) on bad input. Read it with stream_outputs().

        ``request.params``: SamplingParams, or PoolingParams on a pooling-runner engine (its stream then
        yields one PoolingRequestOutput, when the prompt is done). One engine caches prefixes by their
        content alone: ``request.cache_key`` changes nothing here."""
        self.check_alive()
        request = request.with_arrival_time()
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        stream = _RequestStream(request_id, request.arrival_time)
        # Registered before the engine sees the request, so no output can arrive without a stream.
        self._streams[request_id] = stream
        try:
            await self.run_in_engine_thread(self.engine.add, request)
        except asyncio.CancelledError:
            # The add may still run on the engine thread: abort after it (the thread is FIFO).
            self.abort(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        if not self.is_running:
            self.start()
        self._work.set()

    async def stream_outputs(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Yield the outputs of a request added with ``add`` until it finishes.

        Closing or cancelling the generator before the end aborts the request.
        """
        stream = self._streams.get(request_id)
        if stream is None:
            if self.dead_error is not None:  # the engine failed between add and this read
                raise EngineDeadError(
                    f"The engine failed while running this request: {type(self.dead_error).__name__}: "
                    f"{self.dead_error}"
                )
            raise KeyError(f"No request {request_id!r} in flight.")
        done = False
        try:
            while True:
                output = await stream.get()
                if output.error is not None:
                    done = True
                    raise (RequestFailedError if output.failed else RequestRejectedError)(output.error)
                done = output.finished
                yield output
                if done:
                    return
        finally:
            if done:
                self._streams.pop(request_id, None)
            else:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request at the next iteration of the loop (frees its blocks); safe to call twice."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # finished (the engine has forgotten it) or never added
        if stream.finished:
            return  # the engine is done with it (or the loop already failed it)
        stream.fail(RequestAbortedError(f"Request {request_id} was aborted."))
        logger.info("Aborted request %s.", request_id)
        self._pending_aborts.add(request_id)
        self._work.set()
        if not self.is_running and self.dead_error is None and not self._stopping:
            try:
                self.start()
            except RuntimeError:  # no running loop (interpreter teardown): nothing to free any more
                pass

    async def get_stats(self) -> dict[str, Any]:
        """The engine's stats, read on the engine thread between steps."""
        if self.dead_error is not None:
            return {}
        return await self.run_in_engine_thread(self.engine.get_stats)

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._streams

    @property
    def num_requests_in_flight(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ the loop

    def _iteration(self, aborts: list[str]) -> tuple[list[RequestOutput], bool]:
        """On the engine thread: apply aborts, run one step if there is work, say if more is left."""
        if aborts:
            self.engine.abort_request(aborts)
        if not self.engine.has_unfinished_requests():
            return [], False
        outputs = self.engine.step()
        return outputs, self.engine.has_unfinished_requests()

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        has_more = True
        while True:
            if not has_more and not self._pending_aborts:
                await self._work.wait()
            self._work.clear()
            aborts = list(self._pending_aborts)
            self._pending_aborts.clear()
            try:
                outputs, has_more = await loop.run_in_executor(self._executor, self._iteration, aborts)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - any failure in a step kills the engine
                self._die(exc)
                return
            self._dispatch(outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # its consumer left; the abort is queued
            record_output(output, stream.timing, now, self.output_observer)
            stream.put(output)

    def _die(self, exc: BaseException) -> None:
        logger.error("The engine loop failed; failing %d request(s) in flight", len(self._streams), exc_info=exc)
        self.dead_error = exc
        error = EngineDeadError(f"The engine failed while running this request: {type(exc).__name__}: {exc}")
        for stream in list(self._streams.values()):
            stream.fail(error)
        self._streams.clear()
        if self.on_dead is not None:
            try:
                self.on_dead(exc)
            except Exception:  # noqa: BLE001 - the engine is dead either way
                logger.exception("on_dead callback failed")
