"""ReplicatedEngine: the server's engine front when the engines are replicas on Ray.

It answers what the server asks of AsyncLLMEngine (add, stream_outputs, abort,
check_alive, is_healthy, get_stats, start, shutdown, fail_all_requests, ``engine`` with the
tokenizer and configs, ``output_observer``), so the OpenAI handlers run unchanged. Each request
goes to the replica the router (pagedllm/serving/router.py) chooses from the prompt's token ids and
the requests in flight per live replica; its outputs come back over a Ray streaming generator and
are handed to the consumer as they arrive.

Failure. Every read of a stream races the request's ``interrupt`` future, which is resolved when
its replica is declared down (by a probe, or by another request's stream seeing the actor die)
and when the request is aborted: no consumer waits on a dead replica. A replica that is down
leaves routing at once (router.remove_replica); its requests that have sent nothing to their
client yet run again from the start on another live replica (each replica once at most): a
streamed request before its first output, a non-streamed one (``buffer_outputs``: the consumer
answers only at the end) at any point. The others end with ReplicaFailedError (an error event in
the stream). Ray restarts a dead actor (max_restarts); the health probes
(replica_health.py) put it back into routing when its new engine answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from pagedllm.config import EngineArgs
from pagedllm.engine.async_engine import (
    EngineDeadError,
    OutputObserver,
    RequestAbortedError,
    RequestFailedError,
    RequestRejectedError,
    RequestTiming,
    record_output,
)
from pagedllm.engine.engine_client import EngineClient
from pagedllm.engine.request import EngineRequest
from pagedllm.sequence import RequestOutput
from pagedllm.serving.data_parallel import DataParallelConfig
from pagedllm.serving.ray_replicas import ReplicaEvent
from pagedllm.serving.replica_errors import (
    PromptRefusedError,
    ReplicaFailedError,
    ReplicaUnavailableError,
    event_error,
)
from pagedllm.serving.replica_health import ReplicaHealth
from pagedllm.serving.replica_launch import EngineShell, release_replicas, start_replicas

logger = logging.getLogger(__name__)

# Outputs a replica's stream may run ahead of the front end's reader.
_STREAM_AHEAD = 2


@dataclass(slots=True)
class _Request:
    """A request in flight and where it runs."""

    engine_request: EngineRequest
    token_ids: list[int]  # the prompt's, for the router
    timing: RequestTiming
    replica: int = -1
    generator: Any = None
    # Resolved with the exception to raise when the request's replica goes down or it is aborted.
    interrupt: asyncio.Future | None = None
    delivered: bool = False  # an output reached the consumer
    # The consumer keeps the outputs until the end (a non-streamed response): the client has seen
    # nothing, so the request may run again from the start however far it had got.
    buffered: bool = False
    tried: set[int] = field(default_factory=set)

    @property
    def request_id(self) -> str:
        return self.engine_request.request_id

    @property
    def cache_key(self) -> str | None:
        """The request's prompt_cache_key: the router keeps a key on one replica."""
        return self.engine_request.cache_key


class _ReplicaGone(Exception):
    """The replica's stream broke (actor died, engine failed): the request may run elsewhere."""


class ReplicatedEngine(EngineClient):
    def __init__(
        self,
        shell: EngineShell,
        actors: list[Any],
        router: Any,
        config: DataParallelConfig,
        output_observer: OutputObserver | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
        owns_ray: bool = False,
    ) -> None:
        self.engine = shell
        self.actors = actors
        self.router = router
        self.output_observer = output_observer
        self.on_dead = on_dead
        self.owns_ray = owns_ray
        # The replicas' tensor-parallel placement groups, freed at shutdown.
        self.placement_groups: list[Any] = []
        self.health = ReplicaHealth(actors, config.health_interval_s, config.health_timeout_s,
                                    on_down=self._replica_down, on_up=self._replica_up, on_all_dead=self._die)
        self._requests: dict[str, _Request] = {}
        self._stopping = False
        self.dead_error: BaseException | None = None
        self.num_retries = 0

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs,
        config: DataParallelConfig,
        output_observer: OutputObserver | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
        router: Any = None,
    ) -> ReplicatedEngine:
        """Connect to (or start) Ray, start the replicas and wait for their engines (replica_launch.py)."""
        config.check()
        if router is None:
            from pagedllm.serving.router import make_router

            router = make_router(config.router, engine_args.block_size)
        shell, actors, groups, owns_ray = start_replicas(engine_args, config)
        engine = cls(shell, actors, router, config, output_observer, on_dead, owns_ray)
        engine.placement_groups = groups
        return engine

    # ------------------------------------------------------------------ lifecycle

    @property
    def num_replicas(self) -> int:
        return len(self.actors)

    def live_replicas(self) -> list[int]:
        return self.health.live_replicas()

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and not self._stopping and bool(self.live_replicas())

    @property
    def is_running(self) -> bool:
        return self.health.is_running

    def start(self) -> None:
        """Start the health probes on the running event loop (idempotent)."""
        self.health.start()

    def replica_health(self) -> dict[str, Any]:
        """/health's report: how many replicas serve now."""
        return {"live_replicas": len(self.live_replicas()), "replicas": self.num_replicas}

    def check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"Every engine replica has failed for good: {self.dead_error}")
        if self._stopping:
            raise EngineDeadError("The server is shutting down.")
        if not self.live_replicas():
            raise ReplicaUnavailableError(
                f"No engine replica is live right now (all {self.num_replicas} restarting); retry shortly."
            )

    def fail_all_requests(self, message: str) -> None:
        self._stopping = True
        for request in list(self._requests.values()):
            self._interrupt(request, EngineDeadError(message))

    async def shutdown(self) -> None:
        import ray

        self.fail_all_requests("The server is shutting down.")
        await self.health.stop()
        for request in list(self._requests.values()):
            self.abort(request.request_id)
        release_replicas(self.actors, self.placement_groups)
        if self.owns_ray:
            ray.shutdown()

    def _die(self, exc: BaseException) -> None:
        """Every replica is gone for good (Ray gave up restarting them)."""
        if self.dead_error is not None:
            return
        logger.critical("Every engine replica has failed for good: %s", exc)
        self.dead_error = exc
        self.fail_all_requests(f"Every engine replica has failed for good: {exc}")
        if self.on_dead is not None:
            try:
                self.on_dead(exc)
            except Exception:  # noqa: BLE001 - dead either way
                logger.exception("on_dead callback failed")

    # ------------------------------------------------------------------ replicas up and down

    def _replica_down(self, replica: int, reason: str) -> None:
        """Out of routing at once; its requests are interrupted (they retry or fail on their own)."""
        if not self.health.mark_down(replica):
            return
        logger.warning("replica %d is down (%s); %d live replica(s) left", replica, reason, len(self.live_replicas()))
        self.router.remove_replica(replica)
        for request in list(self._requests.values()):
            if request.replica == replica:
                self._interrupt(request, _ReplicaGone(f"replica {replica} is down ({reason})"))

    def _replica_up(self, replica: int) -> None:
        logger.info("replica %d is live again; it rejoins routing", replica)

    @staticmethod
    def _interrupt(request: _Request, error: BaseException) -> None:
        if request.interrupt is not None and not request.interrupt.done():
            request.interrupt.set_result(error)

    # ------------------------------------------------------------------ requests

    def loads(self, exclude: Collection[int] = ()) -> dict[int, int]:
        """Requests in flight per live replica (the router's ``loads``)."""
        counts = Counter(request.replica for request in self._requests.values())
        return {replica: counts.get(replica, 0) for replica in self.live_replicas() if replica not in exclude}

    async def _routing_token_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        from pagedllm.engine.inputs import parse_prompt

        shell = self.engine
        _, token_ids = await asyncio.to_thread(parse_prompt, prompt, shell.tokenizer,
                                               shell.model_config.hf_config.vocab_size)
        return token_ids

    async def add(self, request: EngineRequest) -> None:
        """Queue one request on the replica the router picks; a refused prompt raises ValueError.

        ``request.cache_key``: requests with the same key go to the same replica while it is live and
        not overloaded (the router's affinity), sharing its prefix cache."""
        self.check_alive()
        if request.request_id in self._requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        request = request.with_arrival_time()
        token_ids = await self._routing_token_ids(request.prompt)
        routed = _Request(request, token_ids, RequestTiming(request.arrival_time))
        self._requests[request.request_id] = routed
        if not self.is_running:
            self.start()
        try:
            await self._submit(routed)
        except BaseException:
            self._forget(routed, abort=True)
            raise

    async def _submit(self, request: _Request) -> None:
        """Start the request on a live replica not tried yet and wait for its engine to accept it."""
        while True:
            if self._stopping or self.dead_error is not None:
                self.check_alive()
            loads = self.loads(exclude=request.tried)
            if not loads:
                raise ReplicaUnavailableError(
                    f"No engine replica could take request {request.request_id} (tried {sorted(request.tried)}; "
                    f"{len(self.live_replicas())} of {self.num_replicas} live); retry shortly."
                )
            replica = self.router.choose(request.token_ids, loads, cache_key=request.cache_key)
            request.replica = replica
            request.tried.add(replica)
            request.interrupt = asyncio.get_running_loop().create_future()
            # Backpressure: a replica runs at most a couple of outputs ahead of its reader; past that its
            # AsyncLLMEngine keeps only the latest (cumulative) output, so a slow client skips steps
            # instead of piling them up in Ray's object store, as in a single-process server.
            request.generator = self.actors[replica].generate.options(
                num_returns="streaming", _generator_backpressure_num_objects=_STREAM_AHEAD
            ).remote(request.engine_request)
            try:
                event = await self._next_item(request)
            except _ReplicaGone as exc:
                self._replica_down(replica, str(exc))
                continue
            if isinstance(event, ReplicaEvent) and event.kind == "accepted":
                self.router.record(replica, request.token_ids, cache_key=request.cache_key)
                return
            if isinstance(event, ReplicaEvent) and event.kind == "refused":
                raise PromptRefusedError(event.message, event.param)
            if isinstance(event, ReplicaEvent) and event.kind == "engine_dead":
                self._replica_down(replica, event.message)
                continue
            raise RequestFailedError(f"Replica {replica} answered the request with {event!r}.")

    async def _next_item(self, request: _Request) -> Any:
        """The stream's next item, or the interrupt's exception (replica down: _ReplicaGone; abort)."""
        pull = asyncio.ensure_future(_pull(request.generator))
        assert request.interrupt is not None
        try:
            await asyncio.wait({pull, request.interrupt}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            interrupted = not pull.done()
            if interrupted:  # by the interrupt, or the consumer itself was cancelled (client gone)
                pull.cancel()
        if interrupted:
            raise request.interrupt.result()
        try:
            item = pull.result()
        except Exception as exc:
            import ray

            if isinstance(exc, ray.exceptions.RayActorError):
                raise _ReplicaGone(f"replica {request.replica}'s actor died: {type(exc).__name__}") from exc
            raise RequestFailedError(f"Replica {request.replica} failed on this request: "
                                     f"{type(exc).__name__}: {exc}") from exc
        if item is _END_OF_STREAM:  # a replica's stream always ends with a finished output or an event
            raise _ReplicaGone(f"replica {request.replica} ended the stream early")
        return item

    async def stream_outputs(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Yield the outputs of a request added with ``add`` until it finishes (closing aborts it)."""
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"No request {request_id!r} in flight.")
        done = False
        try:
            while True:
                try:
                    item = await self._next_item(request)
                    if isinstance(item, ReplicaEvent):
                        if item.kind == "engine_dead":
                            self._replica_down(request.replica, item.message)
                            raise _ReplicaGone(item.message)
                        done = True
                        raise event_error(item)
                except _ReplicaGone as exc:
                    self._replica_down(request.replica, str(exc))
                    if request.delivered and not request.buffered:  # a rerun would repeat what the client has
                        done = True
                        raise ReplicaFailedError(
                            f"The engine replica serving this request failed after it had started answering "
                            f"({exc}); retry the request."
                        ) from None
                    self.num_retries += 1
                    logger.warning("request %s: %s; running it on another replica", request_id, exc)
                    try:
                        await self._submit(request)
                    except PromptRefusedError as refused:
                        done = True
                        raise RequestRejectedError(str(refused)) from None
                    continue
                record_output(item, request.timing, time.time(), self.output_observer)
                request.delivered = True
                done = item.finished
                yield item
                if done:
                    return
        finally:
            self._forget(request, abort=not done)

    def _forget(self, request: _Request, abort: bool) -> None:
        if self._requests.get(request.request_id) is not request:
            return
        del self._requests[request.request_id]
        self._interrupt(request, RequestAbortedError(f"Request {request.request_id} was aborted."))
        if abort and request.replica >= 0:
            import ray

            try:
                self.actors[request.replica].abort.remote(request.request_id)
                # The replica's generator may wait on backpressure that no reader will relieve now.
                ray.cancel(request.generator)
            except Exception:  # noqa: BLE001 - the replica may be gone; its engine forgot the request then
                logger.debug("abort of %s on replica %d failed", request.request_id, request.replica)

    def buffer_outputs(self, request_ids: Collection[str]) -> None:
        """Say that the consumer hands these requests' outputs to its client only when they finish.

        A replica failure may then rerun them from the start on another replica at any point, not
        only before their first output (same parameters, so a seeded or greedy answer is the same).
        """
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is not None:
                request.buffered = True

    def abort(self, request_id: str) -> None:
        """Abort a request on its replica (frees its blocks there); safe to call twice."""
        request = self._requests.get(request_id)
        if request is not None:
            logger.info("Aborted request %s.", request_id)
            self._forget(request, abort=True)

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_requests_in_flight(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ stats

    async def get_stats(self) -> dict[str, Any]:
        """{"replicas": {id: engine stats of each live replica}, "router": router.stats(), ...}."""
        live = self.live_replicas()
        loads = self.loads()

        async def one(replica: int) -> dict[str, Any] | None:
            try:
                return await asyncio.wait_for(_await_ref(self.actors[replica].get_stats.remote()), timeout=5)
            except Exception:  # noqa: BLE001 - a replica going down has no stats this scrape
                return None

        results = await asyncio.gather(*(one(replica) for replica in live))
        replicas = {replica: stats for replica, stats in zip(live, results) if stats is not None}
        for replica, stats in replicas.items():
            stats["requests_in_flight"] = loads.get(replica, 0)
        return {
            "replicas": replicas,
            "replica_live": {replica: replica in live for replica in range(self.num_replicas)},
            "router": self.router.stats(),
            "request_retries": self.num_retries,
        }

    # ------------------------------------------------------------------ the dashboard's view of the replicas

    @property
    def has_stopped(self) -> bool:
        """True once the server stops or every replica failed for good (not while replicas restart)."""
        return self._stopping or self.dead_error is not None

    def replica_states(self) -> list[dict[str, Any]]:
        """Every replica and whether it serves now: [{"replica": 0, "live": True}, ...]."""
        return [{"replica": replica, "live": self.health.is_live(replica)} for replica in range(self.num_replicas)]

    def replica_of(self, request_id: str) -> int | None:
        """The replica running a request in flight (None once it is gone)."""
        request = self._requests.get(request_id)
        return request.replica if request is not None and request.replica >= 0 else None

    async def capture_replica_snapshot(self, replica: int, timeout_s: float = 5.0) -> dict[str, Any]:
        """One replica's pool and queues (engine/snapshot.py), taken in its actor between two of its steps.

        ReplicaUnavailableError while the replica is down, or when it does not answer in time.
        """
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"No replica {replica}: there are {self.num_replicas} (0 to {self.num_replicas - 1}).")
        if not self.health.is_live(replica):
            raise ReplicaUnavailableError(f"Replica {replica} is down; Ray is restarting it.")
        try:
            snapshot = await asyncio.wait_for(_await_ref(self.actors[replica].snapshot.remote()), timeout=timeout_s)
        except TimeoutError:
            raise ReplicaUnavailableError(f"Replica {replica} did not answer within {timeout_s:g} s.") from None
        except EngineDeadError as exc:
            raise ReplicaUnavailableError(f"Replica {replica}'s engine has failed: {exc}") from None
        except Exception as exc:
            import ray

            if isinstance(exc, ray.exceptions.RayActorError):
                raise ReplicaUnavailableError(f"Replica {replica}'s actor died: {type(exc).__name__}") from None
            raise
        snapshot["replica"] = replica
        return snapshot


_END_OF_STREAM = object()


async def _pull(generator: Any) -> Any:
    try:
        ref = await generator.__anext__()
    except StopAsyncIteration:  # (a future cannot carry it)
        return _END_OF_STREAM
    return await ref


async def _await_ref(ref: Any) -> Any:
    return await ref
