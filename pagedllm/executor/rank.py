"""What a tensor-parallel rank other than rank 0 runs: join the group, build its Worker, serve steps.

The same body serves a spawned child, a torchrun process and a Ray actor (ray_ranks.py). A rank
beats a heartbeat into rank 0's rendezvous store, publishes its error there when it fails, and
leaves when the engine's process is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagedllm.executor.messages import STOP, StepDecoder, broadcast_bytes
from pagedllm.layers.parallel_state import TensorParallelState, destroy_tensor_parallel, init_tensor_parallel
from pagedllm.worker.worker_config import WorkerConfig

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
HEARTBEAT_S = 1.0
_STORE_PREFIX = "pagedllm/"


@dataclass(slots=True)
class WorkerSpec:
    """Everything a rank needs to build its Worker (picklable, sent once at start-up): the worker's
    config (the model config's values only, see ``plain_config``) and the collectives' timeout."""

    worker: WorkerConfig
    timeout_s: float


class PlainConfig:
    """A model config's values as plain attributes: pickles without transformers, whose import costs
    workers several seconds of start-up."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def standardize_rope_params(self) -> None:
        """transformers' rope functions (yarn, llama3, ...) call this first to turn a legacy
        ``rope_scaling`` into ``rope_parameters``; the values here come from a config that already did."""


def plain_config(hf_config: Any) -> PlainConfig:
    """Every public plain-data attribute of a transformers config, aliases (attribute_map) included."""
    values: dict[str, Any] = {}
    for name in dir(hf_config):
        if name.startswith("_") and name != "_remove_final_layer_norm":
            continue
        try:
            value = getattr(hf_config, name)
        except Exception:  # noqa: BLE001 - a property that does not apply to this config
            continue
        if isinstance(value, (int, float, str, bool, list, tuple, dict, type(None))):
            values[name] = value
    for alias in getattr(hf_config, "attribute_map", None) or {}:  # e.g. GPT-2's hidden_size -> n_embd
        values[alias] = getattr(hf_config, alias)
    return PlainConfig(values)


def collective_timeout_s() -> float:
    return float(os.environ.get("PAGEDLLM_TP_TIMEOUT", DEFAULT_TIMEOUT_S))


def rank_device(device: torch.device, rank: int) -> torch.device:
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def client_store(addr: str, port: int, timeout_s: float) -> dist.Store:
    store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(_STORE_PREFIX, store)


def build_worker(config: WorkerConfig, rank: int, world_size: int, device: torch.device) -> Any:
    """This rank's Worker, on ``device`` (its own GPU, or the CPU)."""
    from pagedllm.worker.worker import Worker

    return Worker(dataclasses.replace(config, device=device), rank=rank, world_size=world_size)


def serve_steps(worker: Any, state: TensorParallelState) -> None:
    """A worker rank's loop: receive a step, run the forward pass on this shard, until STOP."""
    decoder = StepDecoder()
    while True:
        step = decoder.decode(broadcast_bytes(state, None))
        if step is STOP:
            return
        worker.execute(step)


def _heartbeat(store: dist.Store, rank: int, parent_pid: int | None, stop: threading.Event) -> None:
    """Tell rank 0 this rank lives; leave at once if the engine's process is gone (no orphans)."""
    beat = 0
    while not stop.wait(HEARTBEAT_S):
        if parent_pid is not None and os.getppid() != parent_pid:
            os._exit(3)
        beat += 1
        try:
            store.set(f"heartbeat/{rank}", str(beat))
        except Exception:  # noqa: BLE001 - the store lives on rank 0: gone means the engine is gone
            if parent_pid is not None:
                os._exit(3)
            return


def run_worker(
    rank: int, world_size: int, addr: str, port: int, spec: WorkerSpec, device: torch.device, parent_pid: int | None
) -> None:
    """Body of ranks 1..N-1 (spawned child or torchrun process): join, load the shard, serve steps."""
    store = None
    stop = threading.Event()
    try:
        state = init_tensor_parallel(rank, world_size, f"tcp://{addr}:{port}", device, spec.timeout_s)
        store = client_store(addr, port, spec.timeout_s)
        threading.Thread(
            target=_heartbeat, args=(store, rank, parent_pid, stop), daemon=True, name="pagedllm-heartbeat"
        ).start()
        worker = build_worker(spec.worker, rank, world_size, device)
        serve_steps(worker, state)
    except BaseException as exc:
        logger.error("tensor-parallel rank %d failed: %s", rank, exc)
        if store is not None:
            try:
                store.set(f"error/{rank}", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            except Exception:  # noqa: BLE001 - best effort: the engine may already be gone
                pass
        raise
    finally:
        stop.set()
        destroy_tensor_parallel()
