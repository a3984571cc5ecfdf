"""Data parallelism settings: N whole engine replicas (each its own KV pool) behind one front end.

This module imports no Ray, so the command line checks the flags (and whether Ray is installed)
before any model or Ray process starts. The replicas themselves live in ray_replicas.py, the
front end that routes to them in replica_frontend.py, their health probes in replica_health.py.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

ROUTER_POLICIES = ("prefix", "round_robin", "least_loaded")
EXECUTOR_BACKENDS = ("mp", "ray")
RAY_EXTRA_HINT = "pip install 'pagedllm[ray]' (Ray 2.60.0)"


class DataParallelUnavailableError(ValueError):
    """The data-parallel flags ask for something this install or this version cannot do."""


@dataclass(slots=True)
class DataParallelConfig:
    """vLLM's flag names: --data-parallel-size, --distributed-executor-backend, plus --ray-address, --router."""

    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    ray_address: str | None = None
    router: str = "prefix"
    # Ray restarts a replica whose actor dies this many times (-1: without limit).
    max_restarts: int = -1
    # Seconds between health probes of each replica, and how long one probe may take.
    health_interval_s: float = 0.5
    health_timeout_s: float = 5.0

    @property
    def uses_replicas(self) -> bool:
        """True when the server runs engine replicas on Ray instead of one engine in its own process."""
        return self.data_parallel_size > 1 or self.distributed_executor_backend == "ray"

    def check(self, tensor_parallel_size: int = 1) -> None:
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
        if tensor_parallel_size > 1:
            raise DataParallelUnavailableError(
                "--tensor-parallel-size > 1 is not available with Ray replicas yet (tensor parallelism placed by "
                "Ray across nodes is not there); use one or the other."
            )
        if not ray_installed():
            raise DataParallelUnavailableError(
                f"--data-parallel-size / --distributed-executor-backend ray need Ray, which is not installed: "
                f"{RAY_EXTRA_HINT}."
            )


def ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None
