"""One engine replica as a Ray actor: a whole pagedllm engine (weights, KV pool, scheduler).

The actor wraps an AsyncLLMEngine on Ray's event loop (an async actor), so requests from the
front end batch together exactly as they do in a single-process server. ``generate`` is a Ray
streaming generator: its first item says whether the engine accepted the request (a refusal
carries the engine's message, so the front end answers 400 as before), then every RequestOutput
follows as the engine produces it, and a failure ends the stream with a ReplicaEvent instead of
an exception (a plain value crosses Ray without depending on exception pickling).

An engine that fails for good ends the actor's process (exit code 1) a moment after failing its
streams: Ray counts that as a crash and restarts the actor (``max_restarts``), which rebuilds the
engine. Ray is imported only by ``launch_replicas``; the actor class itself is plain Python.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any

from pagedllm.config import EngineArgs
from pagedllm.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    RequestAbortedError,
    RequestFailedError,
    RequestRejectedError,
)
from pagedllm.engine.request import EngineRequest

logger = logging.getLogger(__name__)

# Seconds between an engine's failure and its process exit: long enough for the failed streams'
# last items to reach the front end, which then reports the engine's message rather than a crash.
_EXIT_DELAY_S = 0.5


@dataclass(frozen=True, slots=True)
class ReplicaEvent:
    """A non-output item of a replica's stream.

    kind: "accepted" (the first item of a queued request), "refused" (the engine refused it:
    bad input; ``param`` names the field), "rejected" (the scheduler refused it after queueing),
    "failed" (the engine failed on this request alone), "aborted", "engine_dead" (the engine
    failed for good, or is stopping: the request may run elsewhere).
    """

    kind: str
    message: str = ""
    param: str | None = None


class EngineReplica:
    """The actor's body (Ray wraps it in launch_replicas)."""

    def __init__(self, engine_args: EngineArgs, replica_id: int) -> None:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s replica {replica_id} %(name)s: "
                                                       "%(message)s")
        self.replica_id = replica_id
        self.async_engine = AsyncLLMEngine.from_engine_args(engine_args, on_dead=self._on_dead)

    def _on_dead(self, exc: BaseException) -> None:
        logger.critical("replica %d: the engine failed (%s); exiting so that Ray restarts this replica",
                        self.replica_id, exc)
        asyncio.get_running_loop().call_later(_EXIT_DELAY_S, os._exit, 1)

    async def describe(self) -> dict[str, Any]:
        """What the front end needs of the engine without its weights (its configs and pool)."""
        engine = self.async_engine.engine
        return {
            "scheduler_config": engine.scheduler_config,
            "cache_config": engine.cache_config,
            "kv_cache_info": dict(engine.kv_cache_info),
            "max_seq_len": engine.max_seq_len,
            "supported_tasks": engine.supported_tasks,
            "layer_placement": engine.layer_placement,
            "pid": os.getpid(),
            "tensor_parallel_placement": self._placement(),
        }

    def _placement(self) -> dict[int, dict[str, Any]]:
        """Each tensor-parallel rank's node id and pid (rank 0: this actor)."""
        ranks = getattr(self.async_engine.engine.worker, "ranks", None)
        if hasattr(ranks, "placement"):
            return ranks.placement()
        import ray

        return {0: {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}}

    async def generate(self, request: EngineRequest) -> Any:
        """Streaming generator: ReplicaEvent("accepted") or a refusal, then the RequestOutputs."""
        engine = self.async_engine
        try:
            await engine.add(request)
        except ValueError as exc:
            yield ReplicaEvent("refused", str(exc), getattr(exc, "param", None))
            return
        except EngineDeadError as exc:
            yield ReplicaEvent("engine_dead", str(exc))
            return
        yield ReplicaEvent("accepted")
        try:
            async for output in engine.stream_outputs(request.request_id):
                yield output
        except RequestRejectedError as exc:
            yield ReplicaEvent("rejected", str(exc))
        except RequestFailedError as exc:
            yield ReplicaEvent("failed", str(exc))
        except RequestAbortedError as exc:
            yield ReplicaEvent("aborted", str(exc))
        except EngineDeadError as exc:
            yield ReplicaEvent("engine_dead", str(exc))

    async def abort(self, request_id: str) -> None:
        self.async_engine.abort(request_id)

    async def check_health(self) -> bool:
        return self.async_engine.is_healthy

    async def get_stats(self) -> dict[str, Any]:
        return await self.async_engine.get_stats()

    async def snapshot(self) -> dict[str, Any]:
        """The dashboard's snapshot of this replica's pool and queues, taken between two steps."""
        from pagedllm.engine.snapshot import capture_between_steps

        return await capture_between_steps(self.async_engine)


def launch_replicas(
    engine_args: EngineArgs, num_replicas: int, max_restarts: int, num_gpus: float = 0.0,
    placement_groups: list[Any] | None = None,
) -> list[Any]:
    """Start ``num_replicas`` EngineReplica actors (Ray must be initialized); returns their handles.

    Each asks Ray for ``engine_args.num_threads`` CPUs, so Ray places replicas where cores are free
    (one per node of one core), and torch in the actor uses exactly those threads. With tensor
    parallelism each replica runs in bundle 0 of its own placement group, whose other bundles its
    engine's ranks take (ray_ranks.py); Ray restarts a replica in the same bundle.
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from pagedllm.executor.ray_ranks import forwarded_env

    num_cpus = engine_args.num_threads or 1
    actor_class = ray.remote(EngineReplica)
    env_vars = forwarded_env()
    options: dict[str, Any] = dict(
        num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=max_restarts, max_task_retries=0,
        # Requests and probes run concurrently on the actor's event loop.
        max_concurrency=10_000,
    )
    if env_vars:
        options["runtime_env"] = {"env_vars": env_vars}
    actors = []
    for replica_id in range(num_replicas):
        if placement_groups is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_groups[replica_id], placement_group_bundle_index=0,
                placement_group_capture_child_tasks=False,
            )
        actors.append(actor_class.options(**options).remote(engine_args, replica_id))
    return actors
