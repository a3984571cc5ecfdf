"""The errors a replicated request can end with, as the OpenAI handlers map them.

ReplicaUnavailableError and ReplicaFailedError are EngineDeadErrors carrying ``http_status`` and
``code`` (ServingContext.engine_error answers with them: 503, retryable); the others are the
single-engine server's own, rebuilt here from a replica's ReplicaEvent.
"""

from __future__ import annotations

from pagedllm.engine.async_engine import (
    EngineDeadError,
    RequestAbortedError,
    RequestFailedError,
    RequestRejectedError,
)
from pagedllm.serving.ray_replicas import ReplicaEvent


class ReplicaUnavailableError(EngineDeadError):
    """No live replica can take the request now (restarting, or all down): retry shortly."""

    http_status = 503
    code = "no_live_replica"


class ReplicaFailedError(EngineDeadError):
    """The replica serving this request failed after it had sent output; the request cannot resume."""

    http_status = 503
    code = "replica_failed"


class PromptRefusedError(ValueError):
    """The replica's engine refused the prompt (the engine's own ValueError, with the field it names)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def event_error(event: ReplicaEvent) -> BaseException:
    """The exception a stream raises for a replica's final event (not engine_dead: that one retries)."""
    if event.kind == "rejected":
        return RequestRejectedError(event.message)
    if event.kind == "aborted":
        return RequestAbortedError(event.message)
    if event.kind == "refused":
        return PromptRefusedError(event.message, event.param)
    return RequestFailedError(event.message)
