"""A tiny engine loop without a model, for scheduler tests: tokens are a function of position.

The fake worker keeps a simulated KV cache where position p holds the tuple of tokens [0, p];
each step every scheduled sequence is read back through its block table before its new tokens
(a decode's one, or a prompt chunk) are written. Because the "sampled" token depends only on
(request, sample index, length), the final outputs must be the same whatever the pool size,
token budget, chunking, preemption mode or prefix caching: a strong end-to-end check that
preemption, swapping, copy-on-write, chunks and prefix hits never lose or corrupt state. The
bookkeeping after each step is the scheduler's own ``update``, as in the real engine.
"""

from __future__ import annotations

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core import GPU, Scheduler, SchedulerOutputs
from pagedllm.engine.engine_core import EngineCore
from pagedllm.executor.simulated import SimulatedExecutor
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 4


class FakeKV:
    """Simulated device and CPU caches whose slots hold token prefixes (paged managers only)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.bm = scheduler.block_manager
        self.memory: dict[str, dict[int, list]] = {"gpu": {}, "cpu": {}}

    def _block(self, device: str, block_id: int) -> list:
        return self.memory[device].setdefault(block_id, [None] * self.bm.block_size)

    def apply(self, out: SchedulerOutputs) -> None:
        assert not (out.blocks_to_swap_in and out.blocks_to_swap_out)
        for gpu_id, cpu_id in out.blocks_to_swap_out:
            self.memory["cpu"][cpu_id] = list(self._block("gpu", gpu_id))
        for cpu_id, gpu_id in out.blocks_to_swap_in:
            self.memory["gpu"][gpu_id] = list(self._block("cpu", cpu_id))
        for src, dst in out.blocks_to_copy:
            self.memory["gpu"][dst] = list(self._block("gpu", src))

    def write(self, seq: Sequence, num_tokens: int) -> None:
        table = self.bm.block_tables[seq.seq_id]
        tokens = seq.get_token_ids()
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_tokens):
            block = table[pos // BS]
            assert block.device == GPU
            self._block(GPU, block.block_id)[pos % BS] = tuple(tokens[: pos + 1])

    def check(self, seq: Sequence) -> None:
        table = self.bm.block_tables[seq.seq_id]
        tokens = seq.get_token_ids()
        for pos in range(seq.num_computed_tokens):
            block = table[pos // BS]
            assert self._block(block.device, block.block_id)[pos % BS] == tuple(tokens[: pos + 1])


def fake_token(group: SequenceGroup, sample_index: int, seq_len: int) -> int:
    return (hash(group.request_id) + 7 * sample_index + 3 * seq_len) % 13


class FakeEngine:
    """The engine core's step with a SimulatedExecutor that runs each step on the fake cache."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.bm = scheduler.block_manager
        # Paged managers only; None runs the scheduler alone (contiguous policies, timing).
        self.kv: FakeKV | None = FakeKV(scheduler) if hasattr(scheduler.block_manager, "block_tables") else None
        self.core = EngineCore(scheduler, SimulatedExecutor(fake_token, on_execute=self._run_on_fake_cache))
        self.finished: dict[str, SequenceGroup] = {}
        self.ignored: dict[str, SequenceGroup] = {}
        self.history: list[SchedulerOutputs] = []
        self.first_token_step: dict[str, int] = {}
        self._prefill_steps: set[int] = set()

    def add(
        self,
        request_id: str,
        prompt: list[int] | int,
        max_tokens: int = 4,
        n: int = 1,
        arrival_time: float | None = None,
        use_beam_search: bool = False,
    ) -> SequenceGroup:
        tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
        # One sequence per request; the other samples are forked when the prompt is done.
        seq = Sequence(self.scheduler.next_seq_id(), tokens, BS)
        if use_beam_search:
            params = SamplingParams(n=n, use_beam_search=True, max_tokens=max_tokens, temperature=0.0)
        else:
            params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0)
        group = SequenceGroup(request_id, [seq], params, arrival_time=arrival_time)
        self.scheduler.add_seq_group(group)
        return group

    def is_prefill(self, out: SchedulerOutputs) -> bool:
        """Whether the step computed prompts only (no sequence decoded a generated token)."""
        return id(out) in self._prefill_steps

    def _run_on_fake_cache(self, out: SchedulerOutputs) -> None:
        """The forward pass's effect on the cache: blocks moved, then the step's tokens written."""
        self.history.append(out)
        if self.kv is not None:
            self.kv.apply(out)
        decoded = False
        for group in out.scheduled_seq_groups:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                num_tokens = out.num_scheduled_tokens.get(seq.seq_id, 0)
                decoded |= num_tokens == 1 and seq.get_num_uncomputed_tokens() == 1 and bool(seq.output_token_ids)
                if num_tokens and self.kv is not None:
                    self.kv.check(seq)  # prefix hits and swapped-in blocks hold the right K/V
                    self.kv.write(seq, num_tokens)
        if out.scheduled_seq_groups and not decoded:
            self._prefill_steps.add(id(out))

    def step(self) -> SchedulerOutputs:
        step = self.core.step()
        out, result = step.sched, step.result
        assert not result.failed, result.failed
        for group in (request.group for request in result.requests):
            self.first_token_step.setdefault(group.request_id, len(self.history))
            if group.is_finished():
                self.finished[group.request_id] = group
        for group in out.ignored_seq_groups:
            self.ignored[group.request_id] = group
        self.check_invariants()
        return out

    def check_invariants(self) -> None:
        bm = self.bm
        bm.check_invariants()
        config = self.scheduler.scheduler_config
        running_seqs = sum(g.num_seqs(SequenceStatus.RUNNING) for g in self.scheduler.running)
        assert running_seqs <= config.max_num_seqs
        if self.kv is None:
            return
        assert bm.gpu_allocator.num_used <= bm.num_gpu_blocks
        # The paper's bound: swapped blocks never exceed the device pool (nor the CPU pool).
        assert bm.cpu_allocator.num_used <= min(bm.num_cpu_blocks, bm.num_gpu_blocks)
        for group in self.scheduler.running:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                self.kv.check(seq)

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.scheduler.has_unfinished_seqs():
            self.step()
            steps += 1
            assert steps < max_steps, "the scheduler is stuck"
        assert self.bm.all_free(), "blocks leaked"
        return steps


def make_scheduler(
    num_gpu_blocks: int = 64,
    num_cpu_blocks: int = 0,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    max_model_len: int = 256,
    watermark: float = 0.0,
    preemption_mode: str = "recompute",
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = False,
    kv_allocation: str = "paged",
    batching: str = "iteration",
    long_prefill_token_threshold: int = 0,
    long_prompt_chunk_tokens: int = 0,
    max_prefill_tokens_while_decoding: int = 0,
) -> Scheduler:
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        watermark=watermark,
        preemption_mode=preemption_mode,
        enable_chunked_prefill=enable_chunked_prefill,
        kv_allocation=kv_allocation,
        batching=batching,
        long_prefill_token_threshold=long_prefill_token_threshold,
        long_prompt_chunk_tokens=long_prompt_chunk_tokens,
        max_prefill_tokens_while_decoding=max_prefill_tokens_while_decoding,
    )
    cache_config = CacheConfig(block_size=BS, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(scheduler_config, cache_config, num_gpu_blocks, num_cpu_blocks)


def outputs_of(engine: FakeEngine) -> dict[str, list[list[int]]]:
    return {rid: [seq.output_token_ids for seq in g.seqs] for rid, g in sorted(engine.finished.items())}
