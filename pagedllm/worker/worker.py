"""A worker executes steps: it holds the model shard and the KV pools, and takes no decisions."""

from __future__ import annotations

import logging
import os
import time

import torch

from pagedllm.config import CacheConfig, ModelConfig
from pagedllm.models.loader import build_model
from pagedllm.sampling import Sampler, SamplerOutput
from pagedllm.worker.cache_engine import CacheEngine, decide_num_gpu_blocks, kv_block_bytes
from pagedllm.worker.model_runner import ModelRunner, StepInput

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}.") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no GPU; use device='cpu' or 'auto'.")
    return resolved


class Worker:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: torch.device,
        eos_token_id: int | None,
        max_num_batched_tokens: int,
        seed: int = 0,
        num_threads: int | None = None,
    ) -> None:
        if device.type == "cpu":
            torch.set_num_threads(num_threads or os.cpu_count() or 1)
        self.device = device
        self.model_config = model_config
        self.cache_config = cache_config
        start = time.perf_counter()
        self.model = build_model(model_config, device)
        logger.info("model loaded in %.1f s", time.perf_counter() - start)
        vocab_size = self.model_config.hf_config.vocab_size
        self.sampler = Sampler(eos_token_id=eos_token_id, vocab_size=vocab_size)
        self.runner = ModelRunner(self.model, cache_config.block_size, device, self.sampler)
        if device.type == "cuda" and cache_config.num_kv_blocks is None and cache_config.kv_cache_memory is None:
            # Peak activation memory must stay free: measure it with one maximal step first.
            self.runner.profile_run(min(max_num_batched_tokens, model_config.max_model_len))
            torch.cuda.synchronize(device)
        dtype = model_config.dtype
        self.num_gpu_blocks = decide_num_gpu_blocks(model_config, cache_config, device, dtype)
        block_bytes = kv_block_bytes(model_config, cache_config.block_size, dtype)
        if cache_config.num_cpu_blocks is not None:
            self.num_cpu_blocks = cache_config.num_cpu_blocks
        else:
            # The paper bounds the swap space by the device pool: more could never be used.
            self.num_cpu_blocks = min(cache_config.swap_space // block_bytes, self.num_gpu_blocks)
        self.cache_engine = CacheEngine(
            model_config, cache_config, self.num_gpu_blocks, self.num_cpu_blocks, device, dtype
        )
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def execute(self, step: StepInput) -> SamplerOutput:
        # Block moves first: the forward pass must read the blocks where the scheduler put them.
        # Out before in: a device block freed by a swap-out may be the target of a swap-in.
        self.cache_engine.swap_out(step.blocks_to_swap_out)
        self.cache_engine.swap_in(step.blocks_to_swap_in)
        self.cache_engine.copy_blocks(step.blocks_to_copy)
        if not step.seqs:
            return SamplerOutput(token_ids=[], logprobs=[], top_logprobs=[])
        return self.runner.execute(step, self.cache_engine.kv_caches, self.generator)
