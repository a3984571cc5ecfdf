"""Tensor-parallel state of this process: rank, world size, process groups, and collective timing.

Two groups are kept. The *compute* group (gloo on CPU, NCCL on CUDA) carries the all-reduces and
gathers of the forward pass, with the collective timeout. The *control* group (always gloo, on
CPU tensors) carries each step's message from rank 0, with a long timeout: workers wait on it
while the server is idle, and a dead peer still breaks it at once (its socket closes).

Layers read the *build* state once, when they are built, and keep it: a Worker of a
tensor-parallel group builds its model inside ``building_with(state)``; anything built outside
(a single-process engine, even in the same process as a tensor-parallel one) sees world size 1
and never communicates.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(slots=True)
class CommStats:
    """Seconds spent inside collectives, and bytes of control messages, in this process."""

    all_reduce_s: float = 0.0
    gather_s: float = 0.0
    broadcast_s: float = 0.0
    num_all_reduce: int = 0
    num_gather: int = 0
    num_broadcast: int = 0
    broadcast_bytes: int = 0
    last_message_bytes: int = 0
    # NCCL collectives are asynchronous: synchronising makes the timing true but costs a stall.
    sync_cuda: bool = False
    per_step_s: list[float] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return self.all_reduce_s + self.gather_s + self.broadcast_s

    def as_dict(self) -> dict[str, float | int]:
        return {
            "tp_comm_s": self.total_s,
            "tp_all_reduce_s": self.all_reduce_s,
            "tp_gather_s": self.gather_s,
            "tp_broadcast_s": self.broadcast_s,
            "tp_num_all_reduce": self.num_all_reduce,
            "tp_num_gather": self.num_gather,
            "tp_num_broadcast": self.num_broadcast,
            "tp_broadcast_bytes": self.broadcast_bytes,
            "tp_last_message_bytes": self.last_message_bytes,
        }


@dataclass(slots=True)
class TensorParallelState:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # compute group (None: world size 1)
    control_group: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    stats: CommStats = field(default_factory=CommStats)


_SINGLE = TensorParallelState()
_BUILD_STATE = _SINGLE  # what layers built now will use
_ACTIVE: TensorParallelState | None = None  # this process's group, if it joined one


def get_tp_state() -> TensorParallelState:
    """The state layers built now capture (world size 1 outside ``building_with``)."""
    return _BUILD_STATE


def get_tp_rank() -> int:
    return _BUILD_STATE.rank


def get_tp_world_size() -> int:
    return _BUILD_STATE.world_size


def get_active_tp_state() -> TensorParallelState | None:
    """The group this process joined with init_tensor_parallel, if any."""
    return _ACTIVE


def get_comm_stats() -> CommStats:
    return _ACTIVE.stats if _ACTIVE is not None else _SINGLE.stats


@contextmanager
def building_with(state: TensorParallelState) -> Iterator[None]:
    """Layers built inside take this rank, world size and group."""
    global _BUILD_STATE
    saved = _BUILD_STATE
    _BUILD_STATE = state
    try:
        yield
    finally:
        _BUILD_STATE = saved


def override_tp_state(rank: int, world_size: int) -> contextlib.AbstractContextManager[None]:
    """Build layers as rank ``rank`` of ``world_size`` without a process group (checks, tests, meta models).

    Loading weights needs no communication, so a shard built here is exactly what that rank holds;
    its forward pass, which would all-reduce, must not run.
    """
    return building_with(TensorParallelState(rank=rank, world_size=world_size))


def init_tensor_parallel(
    rank: int,
    world_size: int,
    init_method: str,
    device: torch.device,
    timeout_s: float,
    control_timeout_s: float = 7 * 24 * 3600.0,
) -> TensorParallelState:
    """Join (or form) the default process group and set up the compute and control groups."""
    global _ACTIVE
    if _ACTIVE is not None or dist.is_initialized():
        raise RuntimeError(
            "A tensor-parallel group is already set up in this process; shut the other engine down first."
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=control_timeout_s))
    _ACTIVE = TensorParallelState(rank, world_size, dist.group.WORLD, control, device, CommStats())
    return _ACTIVE


def destroy_tensor_parallel() -> None:
    """Leave the process group (best effort: peers may already be gone) and go back to world size 1."""
    global _ACTIVE
    _ACTIVE = None
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - tearing down after a failure: nothing useful to do
            pass


def _sync(stats: CommStats, tensor: torch.Tensor) -> None:
    if stats.sync_cuda and tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def all_reduce(tensor: torch.Tensor, state: TensorParallelState) -> torch.Tensor:
    """Sum in place across the compute group (timed)."""
    stats = state.stats
    start = time.perf_counter()
    dist.all_reduce(tensor, group=state.group)
    _sync(stats, tensor)
    stats.all_reduce_s += time.perf_counter() - start
    stats.num_all_reduce += 1
    return tensor


def gather_last_dim(tensor: torch.Tensor, state: TensorParallelState) -> torch.Tensor | None:
    """Concatenate every rank's ``tensor`` along the last dim on rank 0; None elsewhere (timed)."""
    stats = state.stats
    start = time.perf_counter()
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(state.world_size)] if state.rank == 0 else None
    dist.gather(tensor, parts, dst=0, group=state.group)
    _sync(stats, tensor)
    stats.gather_s += time.perf_counter() - start
    stats.num_gather += 1
    return torch.cat(parts, dim=-1) if parts is not None else None
