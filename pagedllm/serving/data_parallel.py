"""Data parallelism settings: N whole engine replicas (each its own KV pool) behind one front end.

This module imports no Ray, so the command line checks the flags (and whether Ray is installed)
before any model or Ray process starts. The replicas themselves live in ray_replicas.py, the
front end that routes to them in replica_frontend.py, their health probes in replica_health.py.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from pagedllm.config import EXECUTOR_BACKENDS, SERVER_ARG_GROUPS, setting

REPLICAS_GROUP = SERVER_ARG_GROUPS[3]

ROUTER_POLICIES = ("prefix", "round_robin", "least_loaded")
RAY_EXTRA_HINT = "pip install 'pagedllm[ray]' (Ray 2.60.0)"


class DataParallelUnavailableError(ValueError):
    """The data-parallel flags ask for something this install or this version cannot do."""


@dataclass(slots=True)
class DataParallelConfig:
    """vLLM's flag names: --data-parallel-size, --distributed-executor-backend, plus --ray-address, --router.

    A field declared with setting() is a `pagedllm serve` flag (serve_cli.py); the others are set in code.
    """

    data_parallel_size: int = setting(
        1, REPLICAS_GROUP,
        "Run this many whole engine replicas (each its own KV pool) as Ray actors behind this server (default "
        "1: one engine in this process). Needs pagedllm[ray].",
        aliases=("-dp",), positive=True,
    )
    # serve's --distributed-executor-backend stands in for EngineArgs' field of the same name: its value
    # reaches both.
    distributed_executor_backend: str | None = setting(
        None, REPLICAS_GROUP,
        "ray: run the engine replicas as Ray actors (implied by --data-parallel-size > 1, even with one replica), "
        "each replica's tensor-parallel ranks as Ray actors in a placement group (--placement-group-strategy); "
        "mp: tensor parallelism's worker processes on this machine, one engine in this process.",
        choices=EXECUTOR_BACKENDS,
    )
    ray_address: str | None = setting(
        None, REPLICAS_GROUP,
        "The Ray cluster to join (e.g. auto, or HOST:6379); default: RAY_ADDRESS, or a Ray started on this machine.",
    )
    router: str = setting(
        "prefix", REPLICAS_GROUP,
        "Which replica serves a request: prefix (the replica that cached the prompt's leading blocks, unless it is "
        "overloaded), round_robin or least_loaded (pagedllm/serving/router.py).",
        choices=ROUTER_POLICIES,
    )
    # Ray restarts a replica whose actor dies this many times (-1: without limit).
    max_restarts: int = -1
    # Seconds between health probes of each replica, and how long one probe may take.
    health_interval_s: float = 0.5
    health_timeout_s: float = 5.0

    @property
    def uses_replicas(self) -> bool:
        """True when the server runs engine replicas on Ray instead of one engine in its own process."""
        return self.data_parallel_size > 1 or self.distributed_executor_backend == "ray"

    def check(self) -> None:
        """Refuse settings that cannot work, with what to change; Ray's absence included."""
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise DataParallelUnavailableError(
                f"--data-parallel-size must be an integer >= 1, got {self.data_parallel_size!r}."
            )
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise DataParallelUnavailableError(
                f"--distributed-executor-backend must be one of {list(EXECUTOR_BACKENDS)}, got {backend!r}."
            )
        if self.router not in ROUTER_POLICIES:
            raise DataParallelUnavailableError(f"--router must be one of {list(ROUTER_POLICIES)}, got {self.router!r}.")
        if self.ray_address and not self.uses_replicas:
            raise DataParallelUnavailableError(
                "--ray-address needs --distributed-executor-backend ray (or --data-parallel-size > 1)."
            )
        if not self.uses_replicas:
            return
        if backend == "mp":
            # The mp backend is tensor parallelism's worker processes; replicas are Ray actors only.
            raise DataParallelUnavailableError(
                "--data-parallel-size > 1 is not available with --distributed-executor-backend mp: data-parallel "
                "replicas run on Ray (--distributed-executor-backend ray)."
            )
        if not ray_installed():
            raise DataParallelUnavailableError(
                f"--data-parallel-size / --distributed-executor-backend ray need Ray, which is not installed: "
                f"{RAY_EXTRA_HINT}."
            )


def ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None
