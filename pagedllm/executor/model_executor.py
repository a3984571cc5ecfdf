"""The engine's model executor: one Worker in this process, or rank 0 of a tensor-parallel group.

Both take a StepInput and give a SamplerOutput, and say how many blocks their pools hold;
``make_model_executor`` picks one from the settings, so the engine never branches on which.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagedllm.config import CacheConfig, ModelConfig
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.sampling import SamplerOutput
from pagedllm.step_timing import StepTimer
from pagedllm.worker.model_runner import StepInput
from pagedllm.worker.worker import Worker


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
    model_config: ModelConfig,
    cache_config: CacheConfig,
    device: torch.device,
    eos_token_id: int | None,
    max_num_batched_tokens: int,
    seed: int,
    num_threads: int | None,
    tensor_parallel_size: int = 1,
    distributed_executor_backend: str | None = None,
    placement_group_strategy: str = "STRICT_PACK",
    draft_model_config: ModelConfig | None = None,
) -> ModelExecutor:
    common = (model_config, cache_config, device, eos_token_id, max_num_batched_tokens)
    if tensor_parallel_size == 1:
        return Worker(*common, seed=seed, num_threads=num_threads, draft_model_config=draft_model_config)
    if draft_model_config is not None:
        raise ValueError("speculative decoding with a draft model runs with tensor_parallel_size 1 only.")
    # Same interface as Worker; rank 0 (here) broadcasts each step to ranks 1..N-1.
    return MultiprocExecutor(
        *common, seed=seed, num_threads=num_threads, world_size=tensor_parallel_size,
        backend=distributed_executor_backend or "mp", placement_strategy=placement_group_strategy,
    )
