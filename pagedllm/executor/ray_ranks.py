"""Tensor-parallel ranks 1..N-1 as Ray actors, placed by a Ray placement group.

Rank 0 stays the engine's process (a data-parallel replica's actor, or the user's own process);
ranks 1..N-1 are ``TensorParallelRank`` actors, each in its own bundle of a placement group, so
Ray decides which node runs each shard: ``STRICT_PACK`` (every rank on one node, the default: the
all-reduces stay off the network), ``PACK``, ``SPREAD`` or ``STRICT_SPREAD`` (one rank per node:
a model too big for one box). The ranks then form the same gloo / NCCL group as spawned ranks do,
rendezvousing at rank 0's node address, and serve steps exactly as executor.run_worker does.

Whose placement group: a replica started by the server is itself scheduled in bundle 0 of a
group of N bundles made for it (replica_launch.py), and its ranks take bundles 1..N-1 of that
group (Ray restarts the replica in the same bundle). An engine outside any group (``LLM(...,
distributed_executor_backend="ray")``) makes a group of N-1 bundles for its ranks and removes it
when it shuts down.

Liveness: each rank's long-running ``serve`` call is an object ref; a rank that fails or dies
makes its ref ready (``ray.wait`` without waiting, once per step), and ``ray.get`` of it tells how.
A rank actor is owned by the engine's process, so Ray ends it when that process dies.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from pagedllm.config import PLACEMENT_STRATEGIES
from pagedllm.executor.rank import WorkerSpec, run_worker

logger = logging.getLogger(__name__)


def rank_bundle(num_cpus: float, use_gpu: bool) -> dict[str, float]:
    """One rank's resources: its torch threads' cores, and its GPU."""
    bundle = {"CPU": float(num_cpus)}
    if use_gpu:
        bundle["GPU"] = 1.0
    return bundle


def forwarded_env() -> dict[str, str]:
    """Environment the engine reads (kernel levels, timeouts, hub caches, offline mode), for every node."""
    return {k: v for k, v in os.environ.items() if k.startswith(("PAGEDLLM_", "HF_", "TRANSFORMERS_"))}


def node_address() -> str:
    """This node's address as the cluster knows it: where the other ranks reach rank 0's rendezvous."""
    import ray

    if not ray.is_initialized():
        # RAY_ADDRESS, when set, names the cluster to join; otherwise Ray starts on this machine.
        ray.init(include_dashboard=False, log_to_driver=True)
    return ray.util.get_node_ip_address()


def make_placement_group(bundles: list[dict[str, float]], strategy: str, timeout_s: float, what: str) -> Any:
    """A placement group of ``bundles``, ready; ValueError naming what does not fit if Ray cannot place it."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"placement strategy must be one of {list(PLACEMENT_STRATEGIES)}, got {strategy!r}.")
    group = placement_group(bundles, strategy=strategy, name="")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        nodes = [
            {k: v for k, v in node["Resources"].items() if k in ("CPU", "GPU")}
            for node in ray.nodes() if node.get("Alive")
        ]
        raise ValueError(
            f"Ray could not place {what} within {timeout_s:.0f} s: {len(bundles)} bundle(s) of {bundles[0]} "
            f"with strategy {strategy}, on live nodes with {nodes} (resources in use by other actors are not "
            "free). Use fewer threads per rank (--num-threads), another --placement-group-strategy, or more nodes."
        )
    return group


class TensorParallelRank:
    """The actor's body: one rank's Worker, serving steps until rank 0 sends STOP."""

    def serve(self, rank: int, world_size: int, addr: str, port: int, spec: WorkerSpec) -> None:
        device = spec.worker.device
        if device.type == "cuda":
            device = torch.device("cuda", 0)  # Ray makes this actor's one GPU the only visible one
        # No parent pid to watch: Ray ends this actor when its owner (the engine's process) dies.
        run_worker(rank, world_size, addr, port, spec, device, None)

    def where(self) -> dict[str, Any]:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}


class RayRanks:
    """Ranks 1..world_size-1 on Ray, started in bundles of a placement group; the executor's rank source."""

    def __init__(
        self, world_size: int, addr: str, port: int, spec: WorkerSpec, strategy: str, timeout_s: float
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        use_gpu = spec.worker.device.type == "cuda"
        num_cpus = spec.worker.num_threads or 1
        self._own_group = None
        group = ray.util.get_current_placement_group()
        if group is not None and len(group.bundle_specs) >= world_size:
            first_bundle = 1  # bundle 0 holds this process, rank 0
        else:
            group = make_placement_group(
                [rank_bundle(num_cpus, use_gpu) for _ in range(world_size - 1)], strategy, timeout_s,
                f"{world_size - 1} tensor-parallel rank(s)",
            )
            self._own_group = group
            first_bundle = 0
        actor_class = ray.remote(TensorParallelRank)
        env = forwarded_env()
        self.actors: dict[int, Any] = {}
        self.serving: dict[int, Any] = {}
        for rank in range(1, world_size):
            bundle = group.bundle_specs[first_bundle + rank - 1]
            options: dict[str, Any] = dict(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_restarts=0, max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=first_bundle + rank - 1,
                    placement_group_capture_child_tasks=False,
                ),
            )
            if env:
                options["runtime_env"] = {"env_vars": env}
            actor = actor_class.options(**options).remote()
            self.actors[rank] = actor
            self.serving[rank] = actor.serve.remote(rank, world_size, addr, port, spec)
        self._ray = ray

    def placement(self) -> dict[int, dict[str, Any]]:
        """Each rank's node id and pid (rank 0 is the caller's own process)."""
        ray = self._ray
        found = {rank: ray.get(actor.where.remote(), timeout=30) for rank, actor in self.actors.items()}
        found[0] = {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}
        return found

    def dead_rank(self) -> tuple[int, str] | None:
        """A rank whose serve call ended (it failed, or its actor died), and how; None while all serve."""
        ray = self._ray
        refs = list(self.serving.values())
        if not refs:
            return None
        ended, _ = ray.wait(refs, num_returns=1, timeout=0)
        if not ended:
            return None
        rank = next(r for r, ref in self.serving.items() if ref == ended[0])
        try:
            ray.get(ended[0])
            how = "stopped serving"
        except ray.exceptions.RayActorError as exc:
            how = f"its Ray actor died ({type(exc).__name__})"
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            how = f"failed: {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        return rank, how

    def shutdown(self, grace_s: float) -> None:
        """Wait for the ranks to leave (after STOP), then kill what is left and free the placement group."""
        ray = self._ray
        if self.serving:
            ray.wait(list(self.serving.values()), num_returns=len(self.serving), timeout=grace_s)
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors.clear()
        self.serving.clear()
        if self._own_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._own_group)
            except Exception:  # noqa: BLE001 - the cluster may be gone already
                pass
            self._own_group = None
