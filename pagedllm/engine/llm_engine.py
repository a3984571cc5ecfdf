"""The engine: requests in, one step at a time, RequestOutputs out.

``LLMEngine`` admits requests (checks them, queues them with the scheduler) and runs each step as
the engine core's step (engine/engine_core.py: ``schedule → StepExecutor.execute → Scheduler.update``,
the executor over the model in engine/step_executor.py) followed by the output processor
(engine/output_processor.py: text, stop strings, ``RequestOutput``s). Sequences the output side
ends (a stop string, a request failed alone) go back to the core to be freed.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from pagedllm.config import CacheConfig, EngineArgs, ModelConfig, SchedulerConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step_output import RequestFailure
from pagedllm.engine.beam_search import BeamSearcher
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.inputs import PromptType, check_priority, check_request, parse_prompt
from pagedllm.engine.kv_pool_info import format_bytes, kv_cache_info, kv_dtype_label
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.request import EngineRequest
from pagedllm.engine.step_executor import StepExecutor
from pagedllm.errors import InvalidRequestError
from pagedllm.executor.model_executor import ModelExecutor, make_model_executor
from pagedllm.kernels.report import kernel_summary
from pagedllm.models.loader import load_model_config, load_tokenizer, resolve_tokenizer_path
from pagedllm.pooler_config import PoolerConfig, resolve_runner
from pagedllm.pooling_outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import RequestOutput, Sequence, SequenceGroup, SequenceStatus
from pagedllm.step_timing import StepTimer
from pagedllm.structured import StructuredOutputManager
from pagedllm.worker.draft_model import load_draft_model_config
from pagedllm.worker.worker import resolve_device
from pagedllm.worker.worker_config import WorkerConfig

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        tokenizer: Any,
        device: torch.device,
        seed: int = 0,
        num_threads: int | None = None,
        tensor_parallel_size: int = 1,
        draft_model_config: ModelConfig | None = None,
        distributed_executor_backend: str | None = None,
        placement_group_strategy: str = "STRICT_PACK",
        runner: str = "generate",
        pooler_config: PoolerConfig | None = None,
    ) -> None:
        self.model_config = model_config
        # "generate" serves SamplingParams requests, "pooling" PoolingParams ones (embeddings): vLLM's runners.
        if runner not in ("generate", "pooling"):
            raise ValueError(f"runner must be 'generate' or 'pooling', got {runner!r}.")
        if runner == "pooling" and scheduler_config.speculative_config is not None:
            raise ValueError("speculative decoding is for generation; the pooling runner computes prompts only.")
        self.runner_type = runner
        self.supported_tasks: tuple[str, ...] = ("embed",) if runner == "pooling" else ("generate",)
        self.pooler_config = (pooler_config or PoolerConfig()).resolved(None)
        self.draft_model_config = draft_model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.tokenizer = tokenizer
        self.device = device
        self.seed = seed
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.tensor_parallel_size = tensor_parallel_size
        self.worker: ModelExecutor = make_model_executor(
            WorkerConfig(model_config, cache_config, device, self.eos_token_id,
                         scheduler_config.max_num_batched_tokens, seed, num_threads, draft_model_config),
            tensor_parallel_size, distributed_executor_backend, placement_group_strategy,
        )
        self.num_gpu_blocks = self.worker.num_gpu_blocks
        self.num_cpu_blocks = self.worker.num_cpu_blocks
        # A sequence can never grow past the pool: cap its length there so it ends ("length")
        # instead of preempting itself forever.
        pool_blocks = self.num_gpu_blocks
        if scheduler_config.kv_allocation != "paged":
            # A contiguous run comes from a buddy allocator: at most the largest power of two.
            pool_blocks = 1 << (pool_blocks.bit_length() - 1)
        self.pool_blocks = pool_blocks
        self.max_seq_len = min(model_config.max_model_len, pool_blocks * cache_config.block_size)
        self.scheduler = Scheduler(scheduler_config, cache_config, self.num_gpu_blocks, self.num_cpu_blocks,
                                   self.eos_token_id, self.max_seq_len)
        self.vocab_size = model_config.hf_config.vocab_size
        self.structured_outputs = StructuredOutputManager(tokenizer, self.vocab_size)
        self.beam_searcher = BeamSearcher(self.eos_token_id)
        self._request_counter = itertools.count()
        self._groups: dict[str, SequenceGroup] = {}
        # Per-phase step timing for --profile; the runner times its own phases when in this process.
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        self.step_timer = StepTimer(sync)
        self.step_executor = StepExecutor(self.worker, self.scheduler.block_manager, self.structured_outputs,
                                          self.beam_searcher, self.step_timer, draft_model_config is not None)
        # One step: schedule -> the step executor (the model) -> scheduler.update (engine_core.py).
        self.core = EngineCore(self.scheduler, self.step_executor, self.step_timer)
        self.output_processor = OutputProcessor(tokenizer, self.pooler_config.normalize)
        self.kv_cache_info = kv_cache_info(
            model_config, cache_config, self.num_gpu_blocks, self.num_cpu_blocks, tensor_parallel_size,
            draft_model_config,
        )
        info = self.kv_cache_info
        logger.info(
            "KV pool: %s, %d bytes/token%s (K and V, %d layers, scales included); %d device blocks, %d CPU blocks "
            "of %d tokens; device pool %s, CPU pool %s",
            kv_dtype_label(info), info["kv_bytes_per_token"], " per rank" if tensor_parallel_size > 1 else "",
            model_config.num_layers + (draft_model_config.num_layers if draft_model_config else 0),
            self.num_gpu_blocks, self.num_cpu_blocks, cache_config.block_size,
            format_bytes(info["kv_gpu_pool_bytes"]), format_bytes(info["kv_cpu_pool_bytes"]),
        )
        self.layer_placement = self.worker.layer_placement()
        logger.info("Layers: %s", self.layer_placement)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        device = resolve_device(args.device)
        if device.type == "cpu":
            # A forced kernel level this CPU cannot run is refused here, before any weight loads,
            # with what the CPU lacks.
            logger.info("%s", kernel_summary())
        model_config = load_model_config(
            args.model, args.dtype, args.max_model_len, args.quantization,
            revision=args.revision, download_dir=args.download_dir, gguf_file=args.gguf_file,
        )
        model_config.int8_activations = args.int8_activations
        if args.tokenizer:
            model_config.tokenizer_path = resolve_tokenizer_path(args.tokenizer, args.download_dir)
        tokenizer = load_tokenizer(model_config)
        speculative_config = args.speculative_config  # parsed by EngineArgs
        draft_model_config = None
        if speculative_config is not None and speculative_config.method == "draft_model":
            draft_model_config = load_draft_model_config(
                speculative_config.model, model_config, tokenizer, args.download_dir
            )
        cache_config = CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_dtype=args.kv_cache_dtype,
            swap_space=args.swap_space,
            enable_prefix_caching=args.enable_prefix_caching,
            sliding_window=model_config.sliding_window,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=model_config.max_model_len,
            preemption_mode=args.preemption_mode,
            kv_allocation=args.kv_allocation,
            batching=args.batching,
            track_kv_waste=args.track_kv_waste,
            enable_chunked_prefill=args.enable_chunked_prefill,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            long_prompt_chunk_tokens=args.long_prompt_chunk_tokens,
            max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
            speculative_config=speculative_config,
        )
        runner = resolve_runner(args.runner, model_config.model)
        try:
            return cls(
                model_config, cache_config, scheduler_config, tokenizer, device, args.seed, args.num_threads,
                tensor_parallel_size=args.tensor_parallel_size, draft_model_config=draft_model_config,
                distributed_executor_backend=args.distributed_executor_backend,
                placement_group_strategy=args.placement_group_strategy,
                runner=runner,
                # The checkpoint's own pooling settings are read only when it pools.
                pooler_config=(args.pooler_config or PoolerConfig()).resolved(
                    model_config.model if runner == "pooling" else None),
            )
        finally:
            if model_config.gguf_file:
                from pagedllm.models.gguf_loader import forget_parsed_gguf

                # The config, the tokenizer and the weights were read from one parse of the header.
                forget_parsed_gguf()

    # ------------------------------------------------------------------ requests

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue one request; raises ValueError (nothing queued) on bad input.

        ``priority``: lower is scheduled first and preempted last (default 0 for all: FCFS).
        """
        self.add(EngineRequest(request_id, prompt, params, arrival_time, priority))

    def add(self, request: EngineRequest) -> None:
        """``add_request`` with the request as one value (what the async front hands over)."""
        self.enqueue(self.make_seq_group(request))

    def make_seq_group(self, request: EngineRequest) -> SequenceGroup:
        """Everything add_request checks, without queueing (so a batch can be checked first)."""
        request_id, prompt, params = request.request_id, request.prompt, request.params
        if request_id in self._groups:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if isinstance(params, PoolingParams):
            return self._make_pooling_group(request, params)
        if self.runner_type == "pooling":
            raise InvalidRequestError(
                "This engine runs the pooling runner and serves embeddings only (LLM.embed, /v1/embeddings); "
                "start it with runner='generate' to generate text."
            )
        text, token_ids = parse_prompt(prompt, self.tokenizer, self.vocab_size)
        check_request(
            token_ids, params, self.model_config.max_model_len, self.pool_blocks, self.cache_config.block_size,
            max_num_seqs=self.scheduler_config.max_num_seqs, vocab_size=self.vocab_size,
        )
        check_priority(request.priority)
        seq = Sequence(self.scheduler.next_seq_id(), token_ids, self.cache_config.block_size)
        if params.structured_outputs is not None:
            seq.grammar = self.structured_outputs.new_matcher(params.structured_outputs)
        return SequenceGroup(request_id, [seq], params, request.arrival_time, prompt=text, priority=request.priority)

    def _make_pooling_group(self, request: EngineRequest, params: PoolingParams) -> SequenceGroup:
        if self.runner_type != "pooling":
            raise InvalidRequestError(
                "Embeddings are not served by this engine: it runs the generate runner. Start it with "
                "runner='pooling' (--runner pooling, or vLLM's older --task embed) to pool the model's hidden states."
            )
        text, token_ids = parse_prompt(request.prompt, self.tokenizer, self.vocab_size)
        max_model_len = self.model_config.max_model_len
        if len(token_ids) > max_model_len:
            raise InvalidRequestError(
                f"The input is {len(token_ids)} tokens long, longer than the model's context of {max_model_len} "
                "tokens (max_model_len); shorten it.", "input"
            )
        pool_tokens = self.pool_blocks * self.cache_config.block_size
        if len(token_ids) > pool_tokens:
            raise InvalidRequestError(
                f"The input needs {len(token_ids)} KV slots but the whole KV pool holds {pool_tokens} tokens; "
                "raise kv_cache_memory / num_kv_blocks or shorten it.", "input"
            )
        try:
            params.verify(self.model_config.hf_config, str(self.model_config.model))
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "dimensions") from None
        check_priority(request.priority)
        seq = Sequence(self.scheduler.next_seq_id(), token_ids, self.cache_config.block_size)
        # One sequence, no sampling: the scheduler reads these settings as a single-sequence request's.
        return SequenceGroup(request.request_id, [seq], SamplingParams(max_tokens=1), request.arrival_time,
                             prompt=text, priority=request.priority, pooling_params=params,
                             pooling_type=self.pooler_config.pooling_type)

    def enqueue(self, group: SequenceGroup) -> None:
        if group.request_id in self._groups:
            raise ValueError(f"Request id {group.request_id!r} is already in use.")
        if group.sampling_params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(group.sampling_params.seed)
            self.step_executor.generators[group.request_id] = generator
        self._groups[group.request_id] = group
        self.core.add_request(group)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.core.abort_requests(ids)
        for rid in ids:
            group = self._groups.get(rid)
            self._forget(rid)
            if group is not None and group.metrics.finished_time is None:
                group.metrics.finished_time = time.time()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Run one iteration; return the outputs of every request that got tokens or ended in it
        (a pooling request's one output, its embedding, when its prompt is done).

        An exception in the work of one request (building its input, sampling it, beam scoring,
        detokenizing, stop checks, building its output) finishes that request alone with an error
        (``RequestOutput.error``, ``failed``) and frees its blocks; only a failure of the step itself
        (scheduling, the forward pass, the worker) propagates, and is fatal.
        """
        step = self.core.step()
        with self.step_timer.phase("process_outputs"):
            processed = self.output_processor.process(step.result.requests, time.time())
            if processed.stopped:
                self.core.free_finished(processed.stopped)
            outputs = processed.outputs
            for output in outputs:
                if output.finished:
                    self._forget(output.request_id)
            failures = step.result.failed + processed.failed
            if failures:
                outputs.extend(self._fail_requests(failures))
            for group in step.ignored:
                outputs.append(self.output_processor.make_output(group))
                self._forget(group.request_id)
        return outputs

    def _fail_requests(self, failures: list[RequestFailure]) -> list[RequestOutput | PoolingRequestOutput]:
        """Finish requests whose own processing raised: every block they hold freed, an error reported.

        The message names the stage but not the exception (clients see it; the log has the rest).
        """
        now = time.time()
        seqs: list[Sequence] = []
        for failure in failures:
            group = failure.group
            logger.error("request %s failed while %s; finishing it alone", group.request_id, failure.stage,
                         exc_info=failure.error)
            for seq in group.get_seqs():
                if not seq.is_finished():
                    seq.status = SequenceStatus.FINISHED_ABORTED
                seqs.append(seq)
            group.error = (
                f"request {group.request_id} failed while {failure.stage} and was stopped; other requests are "
                "unaffected. Check its parameters; the server log has the details."
            )
            group.failed = True
            group.metrics.finished_time = now
            self._forget(group.request_id)
        self.core.free_finished(seqs)  # the failed groups leave the running queue now
        return [self.output_processor.error_output(failure.group) for failure in failures]

    def _forget(self, request_id: str) -> None:
        self._groups.pop(request_id, None)
        self.step_executor.generators.pop(request_id, None)

    # ------------------------------------------------------------------ introspection

    @property
    def num_steps(self) -> int:
        return self.step_executor.num_steps

    @property
    def num_prompt_tokens(self) -> int:
        return self.scheduler.num_prompt_tokens

    @property
    def num_generation_tokens(self) -> int:
        return self.scheduler.num_generation_tokens

    def get_stats(self) -> dict[str, Any]:
        stats = dict(self.scheduler.get_stats())
        # The pool's format and size (kv_cache_dtype, bytes per token, block counts) never change.
        stats.update(self.kv_cache_info)
        stats.update(
            num_gpu_blocks=self.num_gpu_blocks,
            num_cpu_blocks=self.num_cpu_blocks,
            prompt_tokens=self.num_prompt_tokens,
            generation_tokens=self.num_generation_tokens,
            steps=self.num_steps,
        )
        stats.update(self.structured_outputs.stats())
        stats.update(self.worker.comm_stats())  # tensor parallelism: time in collectives, control message size
        return stats

    def shutdown(self) -> None:
        """Stop tensor-parallel workers, if any (idempotent; a single-process engine has nothing to stop)."""
        self.worker.shutdown()
