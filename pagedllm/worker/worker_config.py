"""What a Worker is built from: one value that the engine fills once and every tensor-parallel rank
receives (pickled to spawned, torchrun and Ray ranks alike)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import CacheConfig, ModelConfig


@dataclass(slots=True)
class WorkerConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    device: torch.device
    eos_token_id: int | None
    # The largest step: on a GPU without a fixed pool size, one maximal step is profiled first.
    max_num_batched_tokens: int
    seed: int = 0
    num_threads: int | None = None  # CPU threads (None: all cores)
    draft_model_config: ModelConfig | None = None  # speculative decoding's draft model (one rank only)
