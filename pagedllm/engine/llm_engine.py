"""The engine loop: add requests, step (schedule -> execute -> postprocess), abort.

The scheduler decides which sequences run, how many tokens each computes and which blocks
move; the worker executes; the scheduler's ``postprocess`` does the step's bookkeeping (computed
tokens, prefix cache, forks, freeing) and hands each sampled token to this module's sink, which
detokenizes and checks stops (or runs beam search). The engine builds the RequestOutputs.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from pagedllm.config import CacheConfig, EngineArgs, ModelConfig, SchedulerConfig
from pagedllm.core.scheduler import Scheduler, SchedulerOutputs, num_samples
from pagedllm.core.speculator import DRAFT_FROM_MODEL
from pagedllm.core.stop_checker import check_stop
from pagedllm.engine.beam_search import BeamSearcher, ranked_outputs
from pagedllm.engine.detokenizer import detokenize_incrementally
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.inputs import PromptType, check_priority, check_request, parse_prompt
from pagedllm.errors import InvalidRequestError
from pagedllm.executor.model_executor import ModelExecutor, make_model_executor
from pagedllm.kernels.report import kernel_summary
from pagedllm.layers.parallel_layers import local_num_kv_heads
from pagedllm.models.loader import load_model_config, load_tokenizer, resolve_tokenizer_path
from pagedllm.pooler_config import PoolerConfig, resolve_runner
from pagedllm.pooling_outputs import PoolingOutput, PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling import SamplerOutput, SamplingRow
from pagedllm.sampling.sampler import rewind_generator
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import (
    CompletionOutput,
    RequestOutput,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from pagedllm.step_timing import StepTimer
from pagedllm.structured import StructuredOutputManager
from pagedllm.worker.cache_engine import pool_block_bytes
from pagedllm.worker.draft_model import load_draft_model_config
from pagedllm.worker.model_runner import SeqStepInput, StepInput
from pagedllm.worker.pooler import accumulate, finish
from pagedllm.worker.worker import resolve_device

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
            model_config, cache_config, device, self.eos_token_id, scheduler_config.max_num_batched_tokens,
            seed, num_threads, tensor_parallel_size, distributed_executor_backend, placement_group_strategy,
            draft_model_config,
        )
        self.num_gpu_blocks = self.worker.num_gpu_blocks
        self.num_cpu_blocks = self.worker.num_cpu_blocks
        self.scheduler = Scheduler(scheduler_config, cache_config, self.num_gpu_blocks, self.num_cpu_blocks)
        self.vocab_size = model_config.hf_config.vocab_size
        # A sequence can never grow past the pool: cap its length there so it ends ("length")
        # instead of preempting itself forever.
        pool_blocks = self.num_gpu_blocks
        if scheduler_config.kv_allocation != "paged":
            # A contiguous run comes from a buddy allocator: at most the largest power of two.
            pool_blocks = 1 << (pool_blocks.bit_length() - 1)
        self.pool_blocks = pool_blocks
        self.max_seq_len = min(model_config.max_model_len, pool_blocks * cache_config.block_size)
        self.structured_outputs = StructuredOutputManager(tokenizer, self.vocab_size)
        self.beam_searcher = BeamSearcher(
            self.scheduler, tokenizer, self.eos_token_id, self.max_seq_len, self.scheduler.next_seq_id
        )
        self._request_counter = itertools.count()
        self._groups: dict[str, SequenceGroup] = {}
        self._generators: dict[str, torch.Generator] = {}
        self.num_steps = 0
        # Per-phase step timing for --profile; the runner times its own phases when in this process.
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        self.step_timer = StepTimer(sync)
        # One step: schedule -> self.execute (the model) -> scheduler.postprocess (engine_core.py).
        self.core = EngineCore(self.scheduler, self, self.step_timer)
        self._early_outputs: list[RequestOutput] = []
        # Without a runner in this process (tensor parallelism) the whole execution counts as "forward".
        self._runner_timed = self.worker.attach_step_timer(self.step_timer)
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
        return cls(
            model_config, cache_config, scheduler_config, tokenizer, device, args.seed, args.num_threads,
            tensor_parallel_size=args.tensor_parallel_size, draft_model_config=draft_model_config,
            distributed_executor_backend=args.distributed_executor_backend,
            placement_group_strategy=args.placement_group_strategy,
            runner=runner,
            # The checkpoint's own pooling settings are read only when it pools.
            pooler_config=(args.pooler_config or PoolerConfig()).resolved(model_config.model if runner == "pooling"
                                                                          else None),
        )

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
        group = self.make_seq_group(request_id, prompt, params, arrival_time, priority)
        self.enqueue(group)

    def make_seq_group(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> SequenceGroup:
        """Everything add_request checks, without queueing (so a batch can be checked first)."""
        if request_id in self._groups:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if isinstance(params, PoolingParams):
            return self._make_pooling_group(request_id, prompt, params, arrival_time, priority)
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
        check_priority(priority)
        seq = Sequence(self.scheduler.next_seq_id(), token_ids, self.cache_config.block_size)
        if params.structured_outputs is not None:
            seq.grammar = self.structured_outputs.new_matcher(params.structured_outputs)
        return SequenceGroup(request_id, [seq], params, arrival_time, prompt=text, priority=priority)

    def _make_pooling_group(
        self, request_id: str, prompt: PromptType, params: PoolingParams, arrival_time: float | None, priority: int
    ) -> SequenceGroup:
        if self.runner_type != "pooling":
            raise InvalidRequestError(
                "Embeddings are not served by this engine: it runs the generate runner. Start it with "
                "runner='pooling' (--runner pooling, or vLLM's older --task embed) to pool the model's hidden states."
            )
        text, token_ids = parse_prompt(prompt, self.tokenizer, self.vocab_size)
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
        check_priority(priority)
        seq = Sequence(self.scheduler.next_seq_id(), token_ids, self.cache_config.block_size)
        # One sequence, no sampling: the scheduler reads these settings as a single-sequence request's.
        return SequenceGroup(request_id, [seq], SamplingParams(max_tokens=1), arrival_time, prompt=text,
                             priority=priority, pooling_params=params, pooling_type=self.pooler_config.pooling_type)

    def enqueue(self, group: SequenceGroup) -> None:
        if group.request_id in self._groups:
            raise ValueError(f"Request id {group.request_id!r} is already in use.")
        if group.sampling_params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(group.sampling_params.seed)
            self._generators[group.request_id] = generator
        self._groups[group.request_id] = group
        self.scheduler.add_seq_group(group)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.scheduler.abort_seq_group(ids)
        for rid in ids:
            group = self._groups.pop(rid, None)
            self._generators.pop(rid, None)
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

        An exception in the work of one request (building its sampling row, sampling it, beam
        scoring, detokenizing, stop checks, building its output) finishes that request alone with
        an error (``RequestOutput.error``, ``failed``) and frees its blocks; only a failure of the
        step itself (scheduling, the forward pass, the worker) propagates, and is fatal.
        """
        step = self.core.step()
        sched, result, sink = step.sched, step.result, step.sink
        outputs, self._early_outputs = self._early_outputs, []
        with self.step_timer.phase("process_outputs"):
            now = time.time()
            for group in result.groups_with_tokens:
                metrics = group.metrics
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                metrics.last_token_time = now
                if group.is_finished():
                    metrics.finished_time = now
                try:
                    outputs.append(self._make_output(group))
                except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                    outputs.append(self._fail_group(group, "building its output", exc))
                    continue
                if group.is_finished():
                    self._forget(group)
            for group, exc in result.failed:
                outputs.append(self._fail_group(group, sink.failed_stages.get(group.request_id), exc))
            if result.failed:
                self.scheduler.free_finished_seq_groups()  # the failed groups leave the running queue now
            for group in sched.ignored_seq_groups:
                outputs.append(self._make_output(group))
                self._forget(group)
        return outputs

    def execute(self, sched: SchedulerOutputs) -> _SamplerTokens:
        """The engine core's executor: the step's input built, the worker's forward pass run, and its
        sampler output (prompt logprobs, model drafts, pooled states taken first) as the step's sink.
        Requests that fail or end while the input is built wait in ``_early_outputs`` for ``step``."""
        timer = self.step_timer
        with timer.phase("prepare_inputs"):
            step_input = self._build_step_input(sched, self._early_outputs)
        if self._runner_timed:  # the worker and runner time their own phases
            sampler_output = self.worker.execute(step_input)
        else:
            with timer.phase("forward"):
                sampler_output = self.worker.execute(step_input)
        self.num_steps += 1
        with timer.phase("process_outputs"):
            self._add_prompt_logprobs(sched, sampler_output.prompt_logprobs)
            self._take_model_drafts(sched, sampler_output.model_draft_token_ids)
            self._take_pooled(sched, sampler_output.pooled)
        return _SamplerTokens(sampler_output, self.tokenizer, self.eos_token_id, self.max_seq_len, self._generators,
                              self.beam_searcher)

    def _build_step_input(self, sched: SchedulerOutputs, early_outputs: list[RequestOutput]) -> StepInput:
        """The worker's input; requests that failed or ended while preparing go to ``early_outputs``."""
        seqs: list[SeqStepInput] = []
        block_manager = self.scheduler.block_manager
        scheduled: list[SequenceGroup] = []
        planned = self._plan_sampling(sched, early_outputs)
        bitmasks, grammar_errors = self._grammar_bitmasks(
            [seq for _, running, rows in planned for seq in running if rows[seq.seq_id]])
        for group, running, rows in planned:
            params = group.sampling_params
            generator = self._generators.get(group.request_id)
            group_seqs: list[SeqStepInput] = []
            try:
                for seq in running:
                    if seq.seq_id in grammar_errors:
                        raise grammar_errors[seq.seq_id]
                if not group.get_seqs(SequenceStatus.RUNNING):  # every sequence's grammar ended it
                    early_outputs.append(self._make_output(group))
                    self._forget(group)
                    continue
                for index, seq in enumerate(seq for seq in running if not seq.is_finished()):
                    num_tokens, num_rows = sched.num_scheduled_tokens[seq.seq_id], rows[seq.seq_id]
                    row = (SamplingRow(params, seq.prompt_token_ids, seq.output_token_ids, generator,
                                       bitmasks.get(seq.seq_id)) if num_rows else None)
                    top_k, next_token = (self._prompt_logprob_chunk(group, seq, num_tokens) if index == 0
                                         else (None, None))
                    drafts = seq.spec_token_ids
                    # A draft model's drafts are stand-ins here: the worker's draft model makes them.
                    model_drafts = len(drafts) if drafts and drafts[0] == DRAFT_FROM_MODEL else 0
                    start = seq.num_computed_tokens
                    previous = (seq.get_token_ids()[start - 1] if self.draft_model_config is not None
                                and start and start >= seq.prompt_len else None)
                    group_seqs.append(
                        SeqStepInput(
                            seq_id=seq.seq_id,
                            token_ids=(seq.get_next_token_ids(num_tokens - len(drafts))
                                       + (drafts if not model_drafts else [])),
                            start_pos=seq.num_computed_tokens,
                            block_table=block_manager.get_block_table(seq),
                            sampling_row=row,
                            num_samples=1 if drafts else max(num_rows, 1),
                            prompt_logprobs=top_k,
                            next_prompt_token=next_token,
                            draft_token_ids=list(drafts) if not model_drafts else [],
                            num_model_drafts=model_drafts,
                            previous_token_id=previous,
                            pooling_type=group.pooling_type,
                        )
                    )
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                early_outputs.append(self._fail_group(group, "preparing its step", exc))
                continue
            seqs.extend(group_seqs)
            scheduled.append(group)
        # A failed group leaves the batch; blocks it freed may still appear in this step's copies
        # and swaps, which is harmless: nothing allocates them before the step runs.
        sched.scheduled_seq_groups = scheduled
        return StepInput(
            seqs=seqs,
            blocks_to_swap_in=sched.blocks_to_swap_in,
            blocks_to_swap_out=sched.blocks_to_swap_out,
            blocks_to_copy=sched.blocks_to_copy,
        )

    def _plan_sampling(
        self, sched: SchedulerOutputs, early_outputs: list[RequestOutput]
    ) -> list[tuple[SequenceGroup, list[Sequence], dict[int, int]]]:
        """Per scheduled group: its sequences that compute tokens this step, and how many sampler rows
        each gets (0 for a chunk mid-prompt)."""
        planned = []
        for group in sched.scheduled_seq_groups:
            try:
                running = [seq for seq in group.get_seqs(SequenceStatus.RUNNING)
                           if sched.num_scheduled_tokens.get(seq.seq_id, 0)]
                rows = {seq.seq_id: num_samples(group, seq, sched.num_scheduled_tokens[seq.seq_id]) for seq in running}
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                early_outputs.append(self._fail_group(group, "preparing its step", exc))
                continue
            planned.append((group, running, rows))
        return planned

    @staticmethod
    def _prompt_logprob_chunk(group: SequenceGroup, seq: Sequence, num_tokens: int) -> tuple[int | None, int | None]:
        """(top-k, the prompt token after the chunk) when this step's tokens of ``seq`` are the next prompt
        chunk whose logprobs the request asked for, else (None, None). Chunks come in order, each
        predicting the next chunk's first token too; never again after a recompute."""
        top_k = group.sampling_params.prompt_logprobs
        prompt_len, start = len(seq.prompt_token_ids), seq.num_computed_tokens
        if top_k is None or start >= prompt_len or len(group.prompt_logprobs or []) != (start + 1 if start else 0):
            return None, None
        end = start + num_tokens
        return top_k, seq.prompt_token_ids[end] if end < prompt_len else None

    @staticmethod
    def _add_prompt_logprobs(sched: SchedulerOutputs, computed: dict[int, list] | None) -> None:
        """Append this step's prompt logprobs (one prompt chunk's) to their groups'."""
        if not computed:
            return
        for group in sched.scheduled_seq_groups:
            for seq in group.seqs:
                if seq.seq_id in computed:
                    # The first token has no logprob: nothing predicts it.
                    group.prompt_logprobs = (group.prompt_logprobs or [None]) + computed[seq.seq_id]

    @staticmethod
    def _take_pooled(sched: SchedulerOutputs, pooled: dict[int, Any] | None) -> None:
        """Fold this step's pooled chunks into their requests' pooling state."""
        if not pooled:
            return
        for group in sched.scheduled_seq_groups:
            for seq in group.seqs:
                if seq.seq_id in pooled:
                    group.pooled_state = accumulate(group.pooled_state, pooled[seq.seq_id], group.pooling_type)

    @staticmethod
    def _take_model_drafts(sched: SchedulerOutputs, drafts: dict[int, list[int]] | None) -> None:
        """The draft model's drafts replace the stand-ins the scheduler booked, before verification."""
        if not drafts:
            return
        for group in sched.scheduled_seq_groups:
            for seq in group.seqs:
                if seq.seq_id in drafts:
                    seq.spec_token_ids = drafts[seq.seq_id]

    def _grammar_bitmasks(self, sampling: list[Sequence]) -> tuple[dict[int, object], dict[int, BaseException]]:
        """This step's bitmask of each constrained sequence that samples, by seq id, filled for the whole
        batch at once (per-request fills cost a tensor allocation and a reduction each); and the
        sequences whose matcher raised. A sequence whose grammar allows no token at all (a constraint
        nothing can satisfy) is finished here.

        A speculating sequence gets ``[drafts + 1, words]``, one mask per sampler row: row j's is the
        grammar's state after drafts[:j] (SeqStepInput.sampling_rows hands them out); its matcher is
        walked through the drafts and rolled back, so verification appends from its own state."""
        constrained = [seq for seq in sampling if seq.grammar is not None]
        if not constrained:
            return {}, {}
        drafts = [seq.spec_token_ids for seq in constrained]
        matchers = [seq.grammar for seq in constrained]
        if any(drafts):
            bitmask, alive, failed = self.structured_outputs.fill_bitmasks(matchers, drafts)
        else:  # the plain call, one row per sequence
            bitmask, alive, failed = self.structured_outputs.fill_bitmasks(matchers)
        masks: dict[int, object] = {}
        errors: dict[int, BaseException] = {}
        row = 0
        for index, seq in enumerate(constrained):
            num_rows = 1 + len(drafts[index])
            if index in failed:
                errors[seq.seq_id] = failed[index]
            elif alive[row]:  # the sequence's own state (the drafts after it were accepted by the grammar)
                masks[seq.seq_id] = bitmask[row] if num_rows == 1 else bitmask[row : row + num_rows]
            else:
                seq.status = SequenceStatus.FINISHED_ABORTED
                seq.stop_reason = "structured output: no token can continue the grammar"
                self.scheduler.free_seq(seq)
            row += num_rows
        return masks, errors

    def _fail_group(self, group: SequenceGroup, stage: str | None, exc: BaseException) -> RequestOutput:
        """Finish a request whose own processing raised: free every block it holds, report an error.

        The message names the stage but not the exception (clients see it; the log has the rest).
        """
        stage = stage or "processing its output"
        logger.error("request %s failed while %s; finishing it alone", group.request_id, stage, exc_info=exc)
        now = time.time()
        for seq in group.get_seqs():
            if not seq.is_finished():
                seq.status = SequenceStatus.FINISHED_ABORTED
            self.scheduler.free_seq(seq)  # a no-op for a sequence that holds no blocks
        group.error = (
            f"request {group.request_id} failed while {stage} and was stopped; other requests are unaffected. "
            "Check its parameters; the server log has the details."
        )
        group.failed = True
        group.metrics.finished_time = now
        self._forget(group)
        try:
            return self._make_output(group)
        except Exception:  # noqa: BLE001 - a bare output still carries the error
            return RequestOutput(
                request_id=group.request_id, prompt=group.prompt,
                prompt_token_ids=list(group.seqs[0].prompt_token_ids) if group.seqs else [],
                outputs=[], finished=True, metrics=group.metrics, error=group.error, failed=True,
            )

    def _forget(self, group: SequenceGroup) -> None:
        self._groups.pop(group.request_id, None)
        self._generators.pop(group.request_id, None)

    def _make_output(self, group: SequenceGroup) -> RequestOutput | PoolingRequestOutput:
        if group.is_pooling:
            return self._make_pooling_output(group)
        params = group.sampling_params
        seqs = group.get_seqs()
        if params.use_beam_search:
            seqs = ranked_outputs(group)  # the best n hypotheses, by length-penalised score
        elif group.is_finished() and params.best_of > params.n:
            # best_of: return the n candidates with the highest cumulative log-probability.
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        completions = [
            CompletionOutput(
                index=i,
                text=seq.output_text,
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.output_logprobs) if params.logprobs is not None else None,
                finish_reason=seq.status.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for i, seq in enumerate(seqs)
        ]
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=group.is_finished(),
            metrics=group.metrics,
            error=group.error,
            failed=group.failed,
            num_cached_tokens=group.num_cached_tokens or 0,
            prompt_logprobs=group.prompt_logprobs,
        )

    def _make_pooling_output(self, group: SequenceGroup) -> PoolingRequestOutput:
        finished = group.is_finished()
        data = None
        if finished and group.error is None:
            data = finish(group.pooled_state, group.pooling_type, group.pooling_params, self.pooler_config.normalize)
            group.pooled_state = None
        return PoolingRequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=None if data is None else PoolingOutput(data),
            finished=finished,
            metrics=group.metrics,
            error=group.error,
            failed=group.failed,
            num_cached_tokens=group.num_cached_tokens or 0,
        )

    # ------------------------------------------------------------------ introspection

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


def kv_cache_info(
    model_config: ModelConfig, cache_config: CacheConfig, num_gpu_blocks: int, num_cpu_blocks: int,
    tensor_parallel_size: int = 1,
    draft_model_config: ModelConfig | None = None,
) -> dict[str, Any]:
    """What the KV pool stores and how big it is, for the start-up log, get_stats(), /metrics and the dashboard.

    ``kv_cache_dtype`` is the setting ("auto" or a quantized format, canonical name);
    ``kv_cache_storage`` what a value is stored as (the model dtype for "auto"). Bytes are this
    rank's share under tensor parallelism (each rank holds its own KV heads); a draft model's layers,
    which share each block, are counted in.
    """
    fmt = cache_config.kv_cache_format
    num_kv_heads = local_num_kv_heads(model_config.num_kv_heads, tensor_parallel_size)
    # MLA's latent row and the draft's layers included.
    block_bytes = pool_block_bytes(model_config, cache_config, model_config.dtype, num_kv_heads, draft_model_config)
    per_token = block_bytes // cache_config.block_size
    return {
        "kv_cache_dtype": fmt.name,
        "kv_cache_storage": fmt.name if fmt.quantized else str(model_config.dtype).removeprefix("torch."),
        "kv_bytes_per_token": per_token,
        "kv_block_bytes": block_bytes,
        "kv_gpu_pool_bytes": block_bytes * num_gpu_blocks,
        "kv_cpu_pool_bytes": block_bytes * num_cpu_blocks,
        "block_size": cache_config.block_size,
        "tensor_parallel_size": tensor_parallel_size,
    }


def kv_dtype_label(info: dict[str, Any]) -> str:
    """The KV dtype as logs and pages show it: "int8", or "auto (bfloat16)" (the dtype "auto" stores)."""
    name = info["kv_cache_dtype"]
    return f"{name} ({info['kv_cache_storage']})" if name == "auto" else name


def format_bytes(num_bytes: float) -> str:
    """1536 -> "1.5 KiB"."""
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            break
        num_bytes /= 1024
    return f"{num_bytes:.0f} B" if unit == "B" else f"{num_bytes:.1f} {unit}"


class _SamplerTokens:
    """The engine's TokenSink: one step's sampler output turned into tokens, text and stops.

    It is handed what it reads (the tokenizer, the stop settings, the requests' generators, the
    beam searcher), never the engine."""

    def __init__(self, sampler_output: SamplerOutput, tokenizer: Any, eos_token_id: int | None, max_seq_len: int,
                 generators: dict[str, torch.Generator], beam_searcher: BeamSearcher) -> None:
        self.output = sampler_output
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.max_seq_len = max_seq_len
        self.generators = generators
        self.beam_searcher = beam_searcher
        self.failed_rows: dict[int, BaseException] = sampler_output.failed_rows
        self.stage = "sampling"
        # What was being done for a request when its processing raised, for the error message.
        self.failed_stages: dict[str, str] = {}

    def _check_rows(self, rows: list[int]) -> None:
        self.stage = "sampling"
        for row in rows:
            if row in self.failed_rows:
                raise self.failed_rows[row]

    def append_token(self, group: SequenceGroup, seq: Sequence, row: int) -> None:
        try:
            self._check_rows([row])
            self.stage = "processing its output"
            output, params = self.output, group.sampling_params
            top = output.top_logprobs[row] if params.logprobs is not None else None
            seq.append_token(output.token_ids[row], output.logprobs[row], top)
            self.stage = "detokenizing"
            new_text = detokenize_incrementally(self.tokenizer, seq, params)
            self.stage = "checking stop conditions"
            check_stop(seq, params, len(new_text), self.eos_token_id, self.max_seq_len)
        except Exception:
            self.failed_stages[group.request_id] = self.stage
            raise

    def drafts_verified(self, group: SequenceGroup, first_row: int, num_rows_used: int) -> None:
        state = self.output.generator_states.get(first_row)
        generator = self.generators.get(group.request_id)
        # Parallel samples share the request's generator and draw in turn: taking one sample's
        # draws back would hand its numbers to the others. They keep every draw (still exact in
        # distribution, reproducible), only a lone sequence is rewound.
        if state is not None and generator is not None and group.num_seqs() == 1:
            rewind_generator(generator, state, num_rows_used, group.sampling_params)

    def step_beams(self, group: SequenceGroup, beams: list[Sequence], rows: list[int]) -> int:
        try:
            self._check_rows(rows)
            self.stage = "scoring beams"
            return self.beam_searcher.step(group, beams, self.output.full_logprobs[rows])
        except Exception:
            self.failed_stages[group.request_id] = self.stage
            raise
