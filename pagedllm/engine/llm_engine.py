"""The engine loop: add requests, step (schedule -> execute -> process outputs), abort.

The scheduler decides which sequences run and which blocks move; the worker executes; this
module turns sampled tokens into sequences' state: appends tokens, forks parallel samples,
detokenizes, checks stops, frees finished sequences, and builds RequestOutputs.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from pagedllm.config import CacheConfig, EngineArgs, ModelConfig, SchedulerConfig
from pagedllm.core.scheduler import Scheduler, SchedulerOutputs
from pagedllm.detokenizer import detokenize_incrementally
from pagedllm.engine.beam_search import BeamSearcher, ranked_outputs
from pagedllm.engine.inputs import InvalidRequestError, PromptType, check_request, parse_prompt
from pagedllm.engine.step_timing import StepTimer
from pagedllm.engine.stop_checker import check_stop
from pagedllm.models.loader import load_model_config, load_tokenizer
from pagedllm.sampling import SamplingRow
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import (
    CompletionOutput,
    RequestOutput,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from pagedllm.structured import StructuredOutputManager
from pagedllm.worker.model_runner import SeqStepInput, StepInput
from pagedllm.worker.worker import Worker, resolve_device

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
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.tokenizer = tokenizer
        self.device = device
        self.seed = seed
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.tensor_parallel_size = tensor_parallel_size
        worker_class: Any = Worker
        worker_kwargs: dict[str, Any] = {}
        if tensor_parallel_size > 1:
            # Same interface as Worker; rank 0 (here) broadcasts each step to ranks 1..N-1.
            from pagedllm.distributed.executor import MultiprocExecutor

            worker_class, worker_kwargs = MultiprocExecutor, {"world_size": tensor_parallel_size}
        self.worker = worker_class(
            model_config,
            cache_config,
            device,
            self.eos_token_id,
            scheduler_config.max_num_batched_tokens,
            seed=seed,
            num_threads=num_threads,
            **worker_kwargs,
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
        self._seq_counter = itertools.count()
        self.structured_outputs = StructuredOutputManager(tokenizer, self.vocab_size)
        self.beam_searcher = BeamSearcher(
            self.scheduler, tokenizer, self.eos_token_id, self.max_seq_len, lambda: next(self._seq_counter)
        )
        self._request_counter = itertools.count()
        self._groups: dict[str, SequenceGroup] = {}
        # What the engine is doing for the group being processed, for a failure's message.
        self._stage: str | None = None  # set before each step of a group's processing
        self._rows_per_group: list[int] = []  # sampler rows of each scheduled group, this step
        self._generators: dict[str, torch.Generator] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps = 0
        # Per-phase step timing for --profile; the runner times its own phases when in this process.
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        self.step_timer = StepTimer(sync)
        runner = getattr(self.worker, "runner", None)
        if runner is not None:
            runner.step_timer = self.step_timer
        # Without a runner in this process (tensor parallelism) the whole execution counts as "forward".
        self._runner_timed = runner is not None
        logger.info(
            "KV pool: %d device blocks, %d CPU blocks of %d tokens", self.num_gpu_blocks, self.num_cpu_blocks,
            cache_config.block_size,
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        device = resolve_device(args.device)
        model_config = load_model_config(args.model, args.dtype, args.max_model_len, args.quantization)
        model_config.int8_activations = args.int8_activations
        if args.tokenizer:
            model_config.tokenizer_path = args.tokenizer
        tokenizer = load_tokenizer(model_config)
        max_num_batched_tokens = args.max_num_batched_tokens or max(model_config.max_model_len, 8192)
        cache_config = CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            num_kv_blocks=args.num_kv_blocks,
            swap_space=args.swap_space,
            enable_prefix_caching=args.enable_prefix_caching,
            sliding_window=model_config.sliding_window,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=model_config.max_model_len,
            preemption_mode=args.preemption_mode,
            kv_allocation=args.kv_allocation,
            batching=args.batching,
            track_kv_waste=args.track_kv_waste,
        )
        return cls(
            model_config, cache_config, scheduler_config, tokenizer, device, args.seed, args.num_threads,
            tensor_parallel_size=args.tensor_parallel_size,
        )

    # ------------------------------------------------------------------ requests

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
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
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> SequenceGroup:
        """Everything add_request checks, without queueing (so a batch can be checked first)."""
        if request_id in self._groups:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        text, token_ids = parse_prompt(prompt, self.tokenizer, self.vocab_size)
        check_request(
            token_ids, params, self.model_config.max_model_len, self.pool_blocks, self.cache_config.block_size,
            max_num_seqs=self.scheduler_config.max_num_seqs, vocab_size=self.vocab_size,
        )
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}.", "priority")
        seq = Sequence(next(self._seq_counter), token_ids, self.cache_config.block_size)
        if params.structured_outputs is not None:
            seq.grammar = self.structured_outputs.new_matcher(params.structured_outputs)
        return SequenceGroup(request_id, [seq], params, arrival_time, prompt=text, priority=priority)

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

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the outputs of every request that ran or ended in it.

        An exception in the work of one request (building its sampling row, sampling it, beam
        scoring, detokenizing, stop checks, building its output) finishes that request alone with
        an error (``RequestOutput.error``, ``failed``) and frees its blocks; only a failure of the
        step itself (scheduling, the forward pass, the worker) propagates, and is fatal.
        """
        timer = self.step_timer
        with timer.phase("schedule"):
            sched = self.scheduler.schedule()
        failed: list[RequestOutput] = []
        with timer.phase("prepare_inputs"):
            step_input = self._build_step_input(sched, failed)
        if self._runner_timed:  # the worker and runner time their own phases
            sampler_output = self.worker.execute(step_input)
        else:
            with timer.phase("forward"):
                sampler_output = self.worker.execute(step_input)
        self.num_steps += 1
        with timer.phase("process_outputs"):
            outputs = failed + self._process_outputs(sched, step_input, sampler_output)
            for group in sched.ignored_seq_groups:
                outputs.append(self._make_output(group))
                self._forget(group)
            self.scheduler.free_finished_seq_groups()
        return outputs

    def _num_rows(self, group: SequenceGroup, seq: Sequence, is_prefill: bool) -> int:
        """Sampler rows of one running sequence this step: best_of on the prompt step of a sampled
        group (the extra samples become forks sharing its blocks), else one."""
        params = group.sampling_params
        is_first = is_prefill and not seq.output_token_ids and not params.use_beam_search
        return params.best_of if is_first else 1

    def _build_step_input(self, sched: SchedulerOutputs, early_outputs: list[RequestOutput]) -> StepInput:
        """The worker's input; requests that failed or ended while preparing go to ``early_outputs``."""
        seqs: list[SeqStepInput] = []
        block_manager = self.scheduler.block_manager
        scheduled: list[SequenceGroup] = []
        self._rows_per_group = []
        for group in sched.scheduled_seq_groups:
            params = group.sampling_params
            generator = self._generators.get(group.request_id)
            running = group.get_seqs(SequenceStatus.RUNNING)
            try:
                bitmasks = self._grammar_bitmasks(group, running)
                if not running:  # every sequence's grammar ended it
                    early_outputs.append(self._make_output(group))
                    self._forget(group)
                    continue
                num_rows = [self._num_rows(group, seq, sched.is_prefill) for seq in running]
                want_prompt_logprobs = params.prompt_logprobs is not None and group.prompt_logprobs is None
                group_seqs = [
                    SeqStepInput(
                        seq_id=seq.seq_id,
                        token_ids=seq.get_uncomputed_token_ids(),
                        start_pos=seq.num_computed_tokens,
                        block_table=block_manager.get_block_table(seq),
                        sampling_row=SamplingRow(params, seq.prompt_token_ids, seq.output_token_ids, generator,
                                                 bitmasks.get(seq.seq_id)),
                        num_samples=num_samples,
                        prompt_logprobs=params.prompt_logprobs if want_prompt_logprobs and index == 0 else None,
                    )
                    for index, (seq, num_samples) in enumerate(zip(running, num_rows))
                ]
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                early_outputs.append(self._fail_group(group, "preparing its step", exc))
                continue
            seqs.extend(group_seqs)
            scheduled.append(group)
            self._rows_per_group.append(sum(num_rows))
        # A failed group leaves the batch; blocks it freed may still appear in this step's copies
        # and swaps, which is harmless: nothing allocates them before the step runs.
        sched.scheduled_seq_groups = scheduled
        return StepInput(
            is_prefill=sched.is_prefill,
            seqs=seqs,
            blocks_to_swap_in=sched.blocks_to_swap_in,
            blocks_to_swap_out=sched.blocks_to_swap_out,
            blocks_to_copy=sched.blocks_to_copy,
        )

    def _grammar_bitmasks(self, group: SequenceGroup, running: list[Sequence]) -> dict[int, object]:
        """Each constrained sequence's bitmask for this step, by seq id. A sequence whose grammar allows
        no token at all (a constraint nothing can satisfy) is finished here and taken out of ``running``."""
        constrained = [seq for seq in running if seq.grammar is not None]
        if not constrained:
            return {}
        bitmask, alive = self.structured_outputs.fill_bitmasks([seq.grammar for seq in constrained], self.num_steps)
        masks: dict[int, object] = {}
        for index, (seq, has_token) in enumerate(zip(constrained, alive)):
            if has_token:
                masks[seq.seq_id] = bitmask[index]
                continue
            seq.status = SequenceStatus.FINISHED_ABORTED
            seq.stop_reason = "structured output: no token can continue the grammar"
            self.scheduler.free_seq(seq)
            running.remove(seq)
        return masks

    def _process_outputs(self, sched: SchedulerOutputs, step_input: StepInput, sampler_output) -> list[RequestOutput]:
        now = time.time()
        outputs: list[RequestOutput] = []
        failed_rows: dict[int, BaseException] = getattr(sampler_output, "failed_rows", None) or {}
        row = 0
        prompt_logprobs = getattr(sampler_output, "prompt_logprobs", None) or {}
        for group, num_rows in zip(sched.scheduled_seq_groups, self._rows_per_group, strict=True):
            running = group.get_seqs(SequenceStatus.RUNNING)
            if running and running[0].seq_id in prompt_logprobs:
                # The first token has no logprob: nothing predicts it.
                group.prompt_logprobs = [None, *prompt_logprobs[running[0].seq_id]]
            # Rows as counted when the batch was built, so a failure cannot shift the next group's.
            first_row = row
            row += num_rows
            self._stage = "sampling"
            try:
                for index in range(first_row, row):
                    if index in failed_rows:
                        raise failed_rows[index]
                self._process_group(group, running, sched.is_prefill, sampler_output, first_row, now)
                self._stage = "building its output"
                output = self._make_output(group)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                outputs.append(self._fail_group(group, self._stage, exc))
                continue
            outputs.append(output)
            if group.is_finished():
                self._forget(group)
        return outputs

    def _process_group(
        self, group: SequenceGroup, running: list[Sequence], is_prefill: bool, sampler_output, row: int, now: float
    ) -> None:
        """Append the sampled tokens of one group (forks, beam step, detokenize, stops)."""
        if group.metrics.first_scheduled_time is None:
            group.metrics.first_scheduled_time = now
            group.metrics.time_in_queue = now - group.metrics.arrival_time
        block_manager = self.scheduler.block_manager
        params = group.sampling_params
        beam_rows: list[int] = []
        self._stage = "processing its output"
        for seq in running:
            was_prompt = not seq.output_token_ids
            num_samples = self._num_rows(group, seq, is_prefill)
            if was_prompt:
                self.num_prompt_tokens += seq.get_len() - seq.num_computed_tokens
            seq.num_computed_tokens = seq.get_len()
            block_manager.mark_computed(seq)
            samples = list(range(row, row + num_samples))
            row += num_samples
            if params.use_beam_search:
                beam_rows.extend(samples)  # the beams advance together, below
                continue
            children = [seq]
            for _ in samples[1:]:
                child = seq.fork(next(self._seq_counter))
                self.scheduler.fork_seq(seq, child)
                group.seqs.append(child)
                children.append(child)
            for target, index in zip(children, samples):
                self._append_token(group, target, sampler_output, index)
        if beam_rows:
            self._stage = "scoring beams"
            logprobs = sampler_output.full_logprobs[beam_rows]
            self.num_generation_tokens += self.beam_searcher.step(group, running, logprobs)
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = now
        group.metrics.last_token_time = now
        if group.is_finished():
            group.metrics.finished_time = now

    def _append_token(self, group: SequenceGroup, seq: Sequence, sampler_output, index: int) -> None:
        params = group.sampling_params
        top = sampler_output.top_logprobs[index] if params.logprobs is not None else None
        seq.append_token(sampler_output.token_ids[index], sampler_output.logprobs[index], top)
        self.num_generation_tokens += 1
        self._stage = "detokenizing"
        new_text = detokenize_incrementally(self.tokenizer, seq, params)
        self._stage = "checking stop conditions"
        check_stop(seq, params, len(new_text), self.eos_token_id, self.max_seq_len)
        if not seq.is_finished() and seq.grammar is not None and seq.grammar.is_terminated():
            seq.status = SequenceStatus.FINISHED_STOPPED  # the grammar accepted its end (with ignore_eos)
        self._stage = "processing its output"
        if seq.is_finished():
            self.scheduler.free_seq(seq)

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

    def _make_output(self, group: SequenceGroup) -> RequestOutput:
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
            prompt_logprobs=group.prompt_logprobs,
        )

    # ------------------------------------------------------------------ introspection

    def get_stats(self) -> dict[str, Any]:
        stats = dict(self.scheduler.get_stats())
        stats.update(
            num_gpu_blocks=self.num_gpu_blocks,
            num_cpu_blocks=self.num_cpu_blocks,
            prompt_tokens=self.num_prompt_tokens,
            generation_tokens=self.num_generation_tokens,
            steps=self.num_steps,
        )
        stats.update(self.structured_outputs.stats())
        comm_stats = getattr(self.worker, "comm_stats", None)
        if comm_stats is not None:  # tensor parallelism: time in collectives, control message size
            stats.update(comm_stats())
        return stats

    def shutdown(self) -> None:
        """Stop tensor-parallel workers, if any (idempotent; a single-process engine has nothing to stop)."""
        shutdown = getattr(self.worker, "shutdown", None)
        if shutdown is not None:
            shutdown()
