"""The engine's model executor: one Worker in this process, or rank 0 of a tensor-parallel group.

Both take a StepInput and give a SamplerOutput, and say how many blocks their pools hold;
``make_model_executor`` picks one from the settings, so the engine never branches on which.
"""

from __future__ import annotations

from typing import Protocol

from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.sampling import SamplerOutput
from pagedllm.step_timing import StepTimer
from pagedllm.worker.model_runner import StepInput
from pagedllm.worker.worker import Worker
from pagedllm.worker.worker_config import WorkerConfig


class ModelExecutor(Protocol):
    num_gpu_blocks: int
    num_cpu_blocks: int

    def execute(self, step: StepInput) -> SamplerOutput: ...

    def attach_step_timer(self, timer: StepTimer) -> bool:
        """Let the runner time its own phases; False when it runs in other processes."""

    def comm_stats(self) -> dict[str, float | int]:
        """Time in collectives and control-message sizes (empty without tensor parallelism)."""

    def layer_placement(self) -> str:
        """Where the model's layers run: the C++ layer loop, or the Python layers and why."""

    def shutdown(self) -> None: ...


def make_model_executor(
    config: WorkerConfig,
    tensor_parallel_size: int = 1,
    distributed_executor_backend: str | None = None,
    placement_group_strategy: str = "STRICT_PACK",
) -> ModelExecutor:
    if tensor_parallel_size == 1:
        return Worker(config)
    # Same interface as Worker; rank 0 (here) broadcasts each step to ranks 1..N-1.
    return MultiprocExecutor(
        config, world_size=tensor_parallel_size, backend=distributed_executor_backend or "mp",
        placement_strategy=placement_group_strategy,
    )
