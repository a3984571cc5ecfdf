"""A worker executes steps: it holds the model shard and the KV pools, and takes no decisions."""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist

from pagedllm.attention.key_offset import calibrate_key_offsets
from pagedllm.layers.parallel_layers import local_num_kv_heads
from pagedllm.layers.parallel_state import TensorParallelState, building_with, get_active_tp_state
from pagedllm.models.decoder import DecoderModel
from pagedllm.models.layer_stack import stack_report
from pagedllm.models.loader import build_model
from pagedllm.sampling import Sampler, SamplerOutput
from pagedllm.step_timing import StepTimer
from pagedllm.worker.cache_engine import CacheEngine, decide_num_gpu_blocks, pool_block_bytes
from pagedllm.worker.model_runner import ModelRunner, StepInput
from pagedllm.worker.worker_config import WorkerConfig

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
    """One tensor-parallel rank (rank 0 of 1 without tensor parallelism).

    With world_size > 1 the process group must already be set up (pagedllm.layers.parallel_state): the
    model is built from it as this rank's shard, the KV pool holds this rank's KV heads, and the
    pool's block count is the minimum over ranks, so every rank can store every block id.
    Only rank 0 samples; the others run the forward pass and their part of the logits.
    """

    def __init__(self, config: WorkerConfig, rank: int = 0, world_size: int = 1) -> None:
        model_config, cache_config, device = config.model_config, config.cache_config, config.device
        draft_model_config = config.draft_model_config
        tp_state = get_active_tp_state() if world_size > 1 else TensorParallelState()
        if tp_state is None or tp_state.world_size != world_size or tp_state.rank != rank:
            raise RuntimeError(f"Worker rank {rank} of {world_size}: the tensor-parallel group is not set up.")
        self.tp_state = tp_state
        self.rank = rank
        self.world_size = world_size
        if device.type == "cpu":
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        self.device = device
        self.model_config = model_config
        self.cache_config = cache_config
        start = time.perf_counter()
        with building_with(tp_state):  # this rank's shard (the whole model when world_size is 1)
            self.model = build_model(model_config, device)
        logger.info("model loaded in %.1f s", time.perf_counter() - start)
        vocab_size = self.model_config.hf_config.vocab_size
        self.drafter = None
        if draft_model_config is not None:
            if world_size > 1:
                raise ValueError("speculative decoding with a draft model runs with tensor_parallel_size 1 only.")
            from pagedllm.worker.draft_model import DraftModelProposer

            start = time.perf_counter()
            self.drafter = DraftModelProposer(
                build_model(draft_model_config, device), cache_config.block_size, device, vocab_size
            )
            logger.info("draft model loaded in %.1f s", time.perf_counter() - start)
        self.sampler = Sampler(eos_token_id=config.eos_token_id, vocab_size=vocab_size)
        self.runner = ModelRunner(self.model, cache_config.block_size, device, self.sampler)
        if device.type == "cuda" and cache_config.num_kv_blocks is None and cache_config.kv_cache_memory is None:
            # Peak activation memory must stay free: measure it with one maximal step first.
            self.runner.profile_run(min(config.max_num_batched_tokens, model_config.max_model_len))
            torch.cuda.synchronize(device)
        dtype = model_config.dtype
        num_kv_heads = local_num_kv_heads(model_config.num_kv_heads, world_size)
        host_share = world_size if device.type == "cpu" else 1
        self.num_gpu_blocks = decide_num_gpu_blocks(
            model_config, cache_config, device, dtype, num_kv_heads, host_share, draft_model_config
        )
        block_bytes = pool_block_bytes(model_config, cache_config, dtype, num_kv_heads, draft_model_config)
        if cache_config.num_cpu_blocks is not None:
            self.num_cpu_blocks = cache_config.num_cpu_blocks
        else:
            # The paper bounds the swap space by the device pool: more could never be used.
            self.num_cpu_blocks = min(cache_config.swap_space // block_bytes, self.num_gpu_blocks)
        if world_size > 1:
            # One block manager on rank 0 hands out ids every rank must hold: size by the smallest rank.
            counts = torch.tensor([self.num_gpu_blocks, self.num_cpu_blocks], dtype=torch.int64)
            dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=tp_state.control_group)
            self.num_gpu_blocks, self.num_cpu_blocks = (int(v) for v in counts.tolist())
        self.cache_engine = CacheEngine(
            model_config, cache_config, self.num_gpu_blocks, self.num_cpu_blocks, device, dtype, num_kv_heads,
            draft_model_config,
        )
        if cache_config.kv_cache_format.integer_grid:
            start = time.perf_counter()
            models = [self.model] + ([self.drafter.runner.model] if self.drafter is not None else [])
            max_len = model_config.max_model_len
            layers = sum(calibrate_key_offsets(model, vocab_size, device, max_len) for model in models)
            logger.info("key offsets of %d attention layers measured in %.1f s", layers, time.perf_counter() - start)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(config.seed)

    def attach_step_timer(self, timer: StepTimer) -> bool:
        self.runner.step_timer = timer
        return True

    def comm_stats(self) -> dict[str, float | int]:
        return {}

    def layer_placement(self) -> str:
        """Where the model's layers run: the C++ layer loop, or the Python layers and why."""
        backbone = getattr(self.model, "model", None)
        if self.device.type != "cpu":
            return f"Python layers ({self.device.type}: the C++ layer loop is for CPUs)"
        if not isinstance(backbone, DecoderModel):
            return f"Python layers ({type(self.model).__name__} is not the decoder the layer programs describe)"
        return stack_report(backbone)

    def shutdown(self) -> None:
        """Nothing runs outside this process."""

    def execute(self, step: StepInput) -> SamplerOutput:
        # Block moves first: the forward pass must read the blocks where the scheduler put them.
        # Out before in: a device block freed by a swap-out may be the target of a swap-in.
        with self.runner.step_timer.phase("prepare_inputs"):
            self.cache_engine.swap_out(step.blocks_to_swap_out)
            self.cache_engine.swap_in(step.blocks_to_swap_in)
            self.cache_engine.copy_blocks(step.blocks_to_copy)
        if not step.seqs:
            return SamplerOutput(token_ids=[], logprobs=[], top_logprobs=[])
        if self.rank != 0:
            return self._execute_shard(step)
        drafts = {}
        if self.drafter is not None:
            with self.runner.step_timer.phase("forward"):
                self.drafter.propose(step, self.cache_engine.draft_kv_caches)
            drafts = {seq.seq_id: seq.draft_token_ids for seq in step.seqs if seq.num_model_drafts}
        output = self.runner.execute(step, self.cache_engine.kv_caches, self.generator)
        output.model_draft_token_ids = drafts
        return output

    @torch.inference_mode()
    def _execute_shard(self, step: StepInput) -> SamplerOutput:
        """A non-zero rank: the forward pass and its slice of the logits (gathered on rank 0), no sampling."""
        input_ids, positions, meta, sample_indices = self.runner.prepare(step)
        hidden = self.model(input_ids, positions, self.cache_engine.kv_caches, meta)
        # The same logits calls, in the same order, as rank 0's runner: prompt logprobs, then samples.
        self.runner.compute_prompt_logits_shard(step, hidden)
        if sample_indices.numel():
            self.model.compute_logits(hidden.index_select(0, sample_indices))
        return SamplerOutput(token_ids=[], logprobs=[], top_logprobs=[])
