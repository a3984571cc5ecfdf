"""Tensor-parallel execution: rank 0 (the engine's process) drives N-1 worker ranks.

The engine keeps its one scheduler and block manager; this executor stands where the single
Worker stood (``execute(step) -> SamplerOutput``, ``num_gpu_blocks``, ``num_cpu_blocks``). Each
step rank 0 broadcasts the control message (see messages.py), then every rank runs the forward
pass on its shard of the heads and of the MLP, writing its own KV heads into the same physical
block ids; rank 0 gathers the logits and samples.

Three ways to get the ranks:
- on one machine (the default, backend "mp"), rank 0 starts ranks 1..N-1 with
  torch.multiprocessing (spawn);
- under torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set), every process
  runs the same command; rank 0 becomes the engine, the others serve steps and exit when it stops;
- on Ray (backend "ray"), ranks 1..N-1 are actors placed by a placement group, on this node or
  others (ray_ranks.py).

Failure: a worker that raises publishes its error in the rendezvous store and exits; a worker
that dies breaks the gloo connection, so rank 0's next collective fails at once (or after the
collective timeout). Either way rank 0 names the rank, stops every remaining worker, and raises
TensorParallelError. Workers exit on their own when rank 0 disappears.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedllm.config import ModelConfig
from pagedllm.executor.messages import STOP, StepEncoder, broadcast_bytes
from pagedllm.executor.rank import (
    HEARTBEAT_S,
    WorkerSpec,
    build_worker,
    client_store,
    collective_timeout_s,
    plain_config,
    rank_device,
    run_worker,
)
from pagedllm.layers.parallel_state import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    override_tp_state,
)
from pagedllm.sampling import SamplerOutput
from pagedllm.step_timing import StepTimer
from pagedllm.worker.model_runner import StepInput
from pagedllm.worker.worker_config import WorkerConfig

logger = logging.getLogger(__name__)



class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died, failed or stopped answering; the engine cannot continue."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local world size) when started by torchrun / an env:// launcher, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        return int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return None


def check_tensor_parallel_config(model_config: ModelConfig, world_size: int) -> None:
    """Build the sharded model on the meta device (no memory): ValueError if heads or MLP do not split."""
    from pagedllm.models.registry import get_model_class

    with override_tp_state(0, world_size), torch.device("meta"):
        get_model_class(model_config.architecture)(model_config.hf_config)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]



def _spawned_main(rank: int, world_size: int, addr: str, port: int, spec: WorkerSpec, parent_pid: int) -> None:
    # Ctrl-C in a terminal reaches the whole process group: let rank 0 decide how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        run_worker(rank, world_size, addr, port, spec, rank_device(spec.worker.device, rank), parent_pid)
    except BaseException:
        sys.exit(1)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class SpawnedRanks:
    """Ranks 1..N-1 as child processes of this one (or none: torchrun started them); the executor's rank source."""

    def __init__(self, processes: dict[int, Any]) -> None:
        self.processes = processes

    def dead_rank(self) -> tuple[int, str] | None:
        """A rank whose process ended, and how; None while all run."""
        for rank, proc in self.processes.items():
            if not proc.is_alive():
                return rank, f"(pid {proc.pid}) is dead ({_describe_exit(proc.exitcode)})"
        return None

    def shutdown(self, grace_s: float) -> None:
        _shutdown_processes(self.processes, grace_s)


class MultiprocExecutor:
    """Rank 0 of a tensor-parallel group; presents the single Worker's interface to the engine."""

    def __init__(
        self, config: WorkerConfig, world_size: int = 2, backend: str = "mp", placement_strategy: str = "STRICT_PACK"
    ) -> None:
        model_config, device, num_threads = config.model_config, config.device, config.num_threads
        if config.draft_model_config is not None:
            raise ValueError("speculative decoding with a draft model runs with tensor_parallel_size 1 only.")
        if world_size < 2:
            raise ValueError(f"MultiprocExecutor needs tensor_parallel_size >= 2, got {world_size}.")
        if backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got {backend!r}.")
        check_tensor_parallel_config(model_config, world_size)
        on_this_machine = backend == "mp" and torchrun_env() is None
        if on_this_machine and device.type == "cuda" and (device.index or 0) + world_size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={world_size} needs {world_size} GPUs from {device}, "
                f"torch sees {torch.cuda.device_count()}."
            )
        timeout_s = collective_timeout_s()
        # Workers get the config's values only: unpickling a transformers config imports transformers.
        worker_model_config = dataclasses.replace(model_config, hf_config=plain_config(model_config.hf_config))
        spec = WorkerSpec(dataclasses.replace(config, model_config=worker_model_config), timeout_s)
        self.world_size = world_size
        self.backend = backend
        self.processes: dict[int, Any] = {}
        self.ranks: Any = SpawnedRanks(self.processes)
        self.error: TensorParallelError | None = None
        self._closed = False
        self._store: dist.Store | None = None
        self.encoder = StepEncoder()
        env = torchrun_env()
        if env is not None:
            rank, env_world, local_world = env
            if env_world != world_size:
                raise ValueError(
                    f"tensor_parallel_size={world_size} but the launcher started WORLD_SIZE={env_world} processes."
                )
            addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            spec.worker.num_threads = num_threads or max(1, (os.cpu_count() or 1) // local_world)
            if device.type == "cuda":
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            if rank != 0:
                # Under torchrun every process runs the user's command: the non-zero ranks serve steps
                # here and leave when rank 0 stops, instead of building a second engine.
                run_worker(rank, world_size, addr, port, spec, device, None)
                raise SystemExit(0)
            init_method = "env://"
        elif backend == "ray":
            from pagedllm.executor.ray_ranks import RayRanks, node_address

            addr, port = node_address(), _free_port()
            init_method = f"tcp://{addr}:{port}"
            # Each rank has its bundle's cores.
            spec.worker.num_threads = num_threads or 1
            self.ranks = RayRanks(world_size, addr, port, spec, placement_strategy, timeout_s)
        else:
            addr, port = "127.0.0.1", _free_port()
            init_method = f"tcp://{addr}:{port}"
            # Ranks share this machine's cores.
            spec.worker.num_threads = num_threads or max(1, (os.cpu_count() or 1) // world_size)
            ctx = mp.get_context("spawn")
            for rank in range(1, world_size):
                proc = ctx.Process(
                    target=_spawned_main,
                    args=(rank, world_size, addr, port, spec, os.getpid()),
                    name=f"pagedllm-tp-rank{rank}",
                    daemon=True,
                )
                proc.start()
                self.processes[rank] = proc
        # Tear the group down however the engine goes away (garbage, interpreter exit).
        self._finalizer = weakref.finalize(self, self.ranks.shutdown, 5.0)
        atexit.register(self.shutdown)
        try:
            self.state = init_tensor_parallel(0, world_size, init_method, device, timeout_s)
            self._store = client_store(addr, port, timeout_s)
            self.worker = build_worker(dataclasses.replace(spec.worker, model_config=model_config), 0, world_size,
                                       device)
        except Exception as exc:
            self.error = self._diagnose(exc, "start-up")
            self.shutdown()
            raise self.error from exc
        self.num_gpu_blocks: int = self.worker.num_gpu_blocks
        self.num_cpu_blocks: int = self.worker.num_cpu_blocks
        self.num_steps = 0
        logger.info("tensor parallel: %d ranks, %d KV blocks each", world_size, self.num_gpu_blocks)

    # ------------------------------------------------------------------ steps

    def execute(self, step: StepInput) -> SamplerOutput:
        if self.error is not None:
            raise self.error
        if self._closed:
            raise TensorParallelError("The tensor-parallel executor has been shut down.")
        try:
            self._check_workers()
            broadcast_bytes(self.state, self.encoder.encode(step))
            output = self.worker.execute(step)
        except TensorParallelError as exc:
            self.error = exc
            self.shutdown()
            raise
        except Exception as exc:
            self.error = self._diagnose(exc, "a step")
            self.shutdown()
            raise self.error from exc
        self.num_steps += 1
        return output

    def _check_workers(self) -> None:
        dead = self.ranks.dead_rank()
        if dead is not None:
            rank, how = dead
            raise TensorParallelError(f"Tensor-parallel worker rank {rank} {how}.", rank)

    def _diagnose(self, exc: BaseException, when: str) -> TensorParallelError:
        """Name the rank behind a failed collective: a reported error, a dead process, or a silent heartbeat."""
        deadline = time.monotonic() + 3.0
        while True:
            error = self._reported_error()
            if error is not None:
                rank, text = error
                return TensorParallelError(f"Tensor-parallel worker rank {rank} failed during {when}: {text}", rank)
            dead = self.ranks.dead_rank()
            if dead is not None:
                rank, how = dead
                return TensorParallelError(f"Tensor-parallel worker rank {rank} {how}, during {when}.", rank)
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        silent = self._silent_ranks()
        if silent:
            return TensorParallelError(
                f"Tensor-parallel worker rank {silent[0]} stopped answering during {when} "
                f"(no heartbeat; ranks silent: {silent}): {exc}",
                silent[0],
            )
        timed_out = "timeout" in str(exc).lower() or "timed out" in str(exc).lower()
        what = "timed out" if timed_out else "failed"
        return TensorParallelError(f"A tensor-parallel collective {what} during {when}: {exc}")

    def _reported_error(self) -> tuple[int, str] | None:
        if self._store is None:
            return None
        for rank in range(1, self.world_size):
            try:
                if self._store.check([f"error/{rank}"]):
                    text = self._store.get(f"error/{rank}").decode(errors="replace")
                    return rank, text.splitlines()[0]
            except Exception:  # noqa: BLE001 - the store is only a diagnosis aid
                return None
        return None

    def _silent_ranks(self) -> list[int]:
        """Ranks whose heartbeat did not move over two beats: stopped, hung or unreachable."""
        if self._store is None:
            return []
        before = self._heartbeats()
        time.sleep(2.5 * HEARTBEAT_S)
        after = self._heartbeats()
        return [rank for rank in before if before[rank] == after[rank]]

    def _heartbeats(self) -> dict[int, bytes]:
        beats: dict[int, bytes] = {}
        for rank in range(1, self.world_size):
            key = f"heartbeat/{rank}"
            try:
                beats[rank] = self._store.get(key) if self._store is not None and self._store.check([key]) else b""
            except Exception:  # noqa: BLE001 - the store is only a diagnosis aid
                beats[rank] = b""
        return beats

    # ------------------------------------------------------------------ stats and teardown

    def layer_placement(self) -> str:
        return "Python layers (tensor-parallel shards: the C++ layer loop runs whole layers)"

    def attach_step_timer(self, timer: StepTimer) -> bool:
        return False  # the runners run in the ranks' processes: the whole execution counts as "forward"

    def comm_stats(self) -> dict[str, float | int]:
        stats: dict[str, float | int] = self.state.stats.as_dict() if hasattr(self, "state") else {}
        stats["tensor_parallel_size"] = self.world_size
        if self.num_steps and "tp_comm_s" in stats:
            stats["tp_comm_s_per_step"] = stats["tp_comm_s"] / self.num_steps
        return stats

    def shutdown(self) -> None:
        """Stop the workers (a STOP message if they can take it, then terminate), leave the group."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self.error is None and hasattr(self, "state"):
            try:
                broadcast_bytes(self.state, self.encoder.encode(STOP))
            except Exception:  # noqa: BLE001 - a dead peer: terminate below
                pass
        # After a failure the workers are dead or stuck in a broken collective: do not wait long.
        self.ranks.shutdown(5.0 if self.error is None else 0.5)
        self._store = None
        destroy_tensor_parallel()
        self._finalizer.detach()


def _shutdown_processes(processes: dict[int, Any], grace_s: float = 5.0) -> None:
    """Join, then terminate, then kill: no worker outlives the engine."""
    deadline = time.monotonic() + grace_s
    for proc in processes.values():
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in processes.values():
        if proc.is_alive():
            proc.terminate()
    for proc in processes.values():
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
