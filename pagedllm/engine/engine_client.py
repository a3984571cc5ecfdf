"""What the server asks of an engine: one engine in this process (AsyncLLMEngine) or data-parallel
replicas behind a router (serving/replica_frontend.py's ReplicatedEngine).

The HTTP layer is written against this class alone. ``generate`` and ``encode`` are written once
here over the two calls each front end implements its own way: ``add`` (queue one ``EngineRequest``,
or route it then queue it) and ``stream_outputs``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Collection
from typing import Any

from pagedllm.engine.request import EngineRequest
from pagedllm.pooling_outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import RequestOutput


class EngineClient(ABC):
    dead_error: BaseException | None

    @property
    @abstractmethod
    def is_running(self) -> bool: ...

    @property
    @abstractmethod
    def is_healthy(self) -> bool: ...

    @property
    @abstractmethod
    def num_requests_in_flight(self) -> int: ...

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    async def shutdown(self) -> None: ...

    @abstractmethod
    def check_alive(self) -> None:
        """Raise EngineDeadError once the engine (every replica) has failed for good."""

    @abstractmethod
    def fail_all_requests(self, message: str) -> None: ...

    @abstractmethod
    async def add(self, request: EngineRequest) -> None:
        """Queue one request, on this engine or on the replica routing picks (by its prompt and
        ``cache_key``); ValueError (nothing queued) on bad input. Without an ``arrival_time`` it
        arrives now."""

    @abstractmethod
    def stream_outputs(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs as they come; aborts the request if the consumer stops early."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort a request (frees its blocks); safe to call twice."""

    @abstractmethod
    def is_in_flight(self, request_id: str) -> bool: ...

    @abstractmethod
    async def get_stats(self) -> dict[str, Any]: ...

    def buffer_outputs(self, request_ids: Collection[str]) -> None:  # noqa: B027 - a no-op for one engine
        """The caller keeps only these requests' final outputs. One engine streams them either way;
        replicas use it to rerun such a request elsewhere when its replica dies."""

    async def generate(
        self, prompt: Any, params: SamplingParams, request_id: str, arrival_time: float | None = None,
        buffered: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        """add + stream_outputs: validation errors raise on the first iteration."""
        await self.add(EngineRequest(request_id, prompt, params, arrival_time))
        if buffered:
            self.buffer_outputs([request_id])
        async for output in self.stream_outputs(request_id):
            yield output

    async def encode(
        self, prompt: Any, params: PoolingParams, request_id: str, arrival_time: float | None = None
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling request (vLLM's name): one PoolingRequestOutput, its ``outputs.data`` the embedding."""
        await self.add(EngineRequest(request_id, prompt, params, arrival_time))
        async for output in self.stream_outputs(request_id):
            yield output  # type: ignore[misc]
