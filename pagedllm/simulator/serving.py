"""The simulated serving loop: the REAL core scheduler and block manager, a cost-model clock.

Each iteration does what LLMEngine.step does, minus the model: requests whose Poisson arrival
time has passed are queued, ``Scheduler.schedule()`` decides the step (any policy, sharing,
preemption, chunked prompts), the cost model turns the step's contents into seconds, the clock
advances, and ``Scheduler.postprocess`` does the engine's bookkeeping, every sequence that
sampled getting one token (parallel samples fork when the prompt is done, exactly as in the
engine). A request ends when its sequences reach the trace's output length. When nothing can
run, the clock jumps to the next arrival.

Results are labelled ``simulated``. Normalized latency = mean over requests of (end-to-end
latency / output length), the paper's metric.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.scheduler import Scheduler, SchedulerOutputs
from pagedllm.core.token_sink import ScriptedTokens
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.simulator.cost_model import CostModel, StepFeatures
from pagedllm.simulator.hardware import HardwareSpec
from pagedllm.simulator.model_shapes import ModelShape
from pagedllm.simulator.traces import TraceRequest

# The paper's systems, as (kv_allocation, batching). "fastertransformer" is request-level
# batching with max-length reservation.
POLICIES: dict[str, tuple[str, str]] = {
    "paged": ("paged", "iteration"),
    "orca-oracle": ("contiguous-oracle", "iteration"),
    "orca-pow2": ("contiguous-pow2", "iteration"),
    "orca-max": ("contiguous-max", "iteration"),
    "fastertransformer": ("contiguous-max", "request"),
}


def kv_pool_blocks(shape: ModelShape, hw: HardwareSpec, block_size: int, max_num_batched_tokens: int,
                   gpu_memory_utilization: float = 0.9) -> int:
    """Blocks that fit as the paper sizes the pool: usable memory - weights - peak activations."""
    memory = hw.mem_bytes * hw.num_devices * gpu_memory_utilization
    free = memory - shape.weight_bytes - shape.activation_bytes(max_num_batched_tokens)
    if free <= 0:
        raise ValueError(f"{shape.name} does not fit on {hw.name}: weights {shape.weight_bytes / 2**30:.1f} GiB")
    return int(free // (shape.kv_bytes_per_token * block_size))


@dataclass(slots=True)
class SimConfig:
    policy: str = "paged"
    block_size: int = 16
    num_gpu_blocks: int = 1000
    num_cpu_blocks: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2560
    max_model_len: int = 2048
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = False
    track_kv_waste: bool = True
    # Off by default: the simulator reproduces the paper's figures, made with whole-prompt steps.
    enable_chunked_prefill: bool = False
    max_steps: int = 2_000_000


@dataclass
class SimResult:
    policy: str
    num_requests: int
    duration_s: float
    normalized_latency_s: float  # mean of latency / output tokens
    mean_latency_s: float
    throughput_req_s: float
    avg_batched_requests: float  # time-weighted mean of running requests per step
    num_steps: int
    num_preempted: int
    num_ignored: int
    stats: dict = field(default_factory=dict)
    kv_waste: dict = field(default_factory=dict)
    simulated: bool = True

    def row(self) -> dict:
        return {k: getattr(self, k) for k in ("policy", "num_requests", "normalized_latency_s", "mean_latency_s",
                                              "throughput_req_s", "avg_batched_requests", "num_preempted",
                                              "num_ignored", "duration_s", "num_steps", "simulated")}


def step_features(out: SchedulerOutputs, block_size: int) -> StepFeatures:
    """The cost model's view of a scheduled step (call it before ``postprocess`` advances it)."""
    f = StepFeatures()
    for group in out.scheduled_seq_groups:
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            new = out.num_scheduled_tokens.get(seq.seq_id, 0)
            if new == 1 and seq.output_token_ids:
                f.decode_seqs += 1
                f.kv_tokens_read += seq.num_computed_tokens + 1
            elif new:
                f.prefill_tokens += new
                # Each new token attends to the cached ones and to the new ones before it.
                f.prefill_attn_pairs += new * seq.num_computed_tokens + new * (new + 1) // 2
    moved = len(out.blocks_to_swap_in) + len(out.blocks_to_swap_out)
    f.swap_blocks = moved
    f.swap_tokens = moved * block_size
    f.copy_tokens = len(out.blocks_to_copy) * block_size
    return f


class _Request:
    __slots__ = ("trace", "group", "finish_time")

    def __init__(self, trace: TraceRequest, group: SequenceGroup) -> None:
        self.trace = trace
        self.group = group
        self.finish_time: float | None = None


def sample_index_token(group: SequenceGroup, seq: Sequence) -> int:
    """A simulated token: the sample's index in its request (outputs differ per sample)."""
    return group.seqs.index(seq)


def make_scheduler(config: SimConfig, kv_allocation: str, batching: str) -> Scheduler:
    """The real scheduler with the simulation's pool and budgets."""
    budget = config.max_num_batched_tokens
    if not config.enable_chunked_prefill:
        budget = max(budget, config.max_model_len)  # whole prompts must fit one step
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=config.max_model_len,
            preemption_mode=config.preemption_mode,
            kv_allocation=kv_allocation,
            batching=batching,
            track_kv_waste=config.track_kv_waste,
            enable_chunked_prefill=config.enable_chunked_prefill,
        ),
        CacheConfig(block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching),
        config.num_gpu_blocks,
        config.num_cpu_blocks,
    )


def simulate(requests: list[TraceRequest], cost_model: CostModel, config: SimConfig) -> SimResult:
    """Serve ``requests`` (sorted by arrival) with ``config.policy`` under ``cost_model``'s clock."""
    if config.policy not in POLICIES:
        raise ValueError(f"unknown policy {config.policy!r}: use one of {', '.join(POLICIES)}")
    kv_allocation, batching = POLICIES[config.policy]
    scheduler = make_scheduler(config, kv_allocation, batching)
    sink = ScriptedTokens(sample_index_token)
    bs = config.block_size
    max_len = min(config.max_model_len, config.num_gpu_blocks * bs)
    pending = sorted(requests, key=lambda r: r.arrival_time)
    live: dict[str, _Request] = {}
    done: list[_Request] = []
    next_arrival = 0
    clock = 0.0
    num_steps = 0
    weighted_batch = 0.0
    busy_time = 0.0
    tracker = scheduler.waste_tracker
    while next_arrival < len(pending) or scheduler.has_unfinished_seqs():
        while next_arrival < len(pending) and pending[next_arrival].arrival_time <= clock:
            trace = pending[next_arrival]
            next_arrival += 1
            # Distinct token ids per request so that no block is shared by accident.
            seq_id = scheduler.next_seq_id()
            prompt = [seq_id * 7919 + i for i in range(trace.prompt_len)]
            seq = Sequence(seq_id, prompt, bs)
            output_len = max(1, min(trace.output_len, max_len - trace.prompt_len))
            params = SamplingParams(n=trace.n, max_tokens=output_len, temperature=1.0 if trace.n > 1 else 0.0,
                                    ignore_eos=True)
            group = SequenceGroup(trace.request_id, [seq], params, arrival_time=trace.arrival_time)
            group.oracle_output_len = output_len
            live[trace.request_id] = _Request(trace, group)
            scheduler.add_seq_group(group)
        out = scheduler.schedule()
        for group in out.ignored_seq_groups:
            request = live.pop(group.request_id)
            request.finish_time = clock
        if out.is_empty():
            if next_arrival < len(pending):
                if tracker is not None:
                    tracker.reweight_last(pending[next_arrival].arrival_time - clock)
                clock = pending[next_arrival].arrival_time  # idle until the next request
                continue
            if scheduler.has_unfinished_seqs() and not out.ignored_seq_groups:
                raise RuntimeError("simulation stuck: requests wait but nothing can run")
            continue
        dt = cost_model.step_time(step_features(out, bs))
        if tracker is not None:
            tracker.reweight_last(dt)
        clock += dt
        busy_time += dt
        num_steps += 1
        weighted_batch += dt * len(out.scheduled_seq_groups)
        if num_steps > config.max_steps:
            raise RuntimeError("simulation did not finish: the scheduler is stuck")
        for group in scheduler.postprocess(out, sink).groups_with_tokens:
            if group.is_finished():
                request = live.pop(group.request_id)
                request.finish_time = clock
                done.append(request)
    assert scheduler.block_manager.all_free(), "the simulation leaked KV blocks"
    latencies = [(r.finish_time - r.trace.arrival_time) for r in done]
    normalized = [lat / r.group.sampling_params.max_tokens for lat, r in zip(latencies, done)]
    stats = scheduler.get_stats()
    return SimResult(
        policy=config.policy,
        num_requests=len(done),
        duration_s=clock,
        normalized_latency_s=statistics.fmean(normalized) if normalized else math.nan,
        mean_latency_s=statistics.fmean(latencies) if latencies else math.nan,
        throughput_req_s=len(done) / clock if clock > 0 else math.nan,
        avg_batched_requests=weighted_batch / busy_time if busy_time > 0 else 0.0,
        num_steps=num_steps,
        num_preempted=stats["num_preempted"],
        num_ignored=stats["num_ignored"],
        stats={k: v for k, v in stats.items() if k != "kv_waste"},
        kv_waste=stats.get("kv_waste", {}),
    )


def sustained_rate(rates: list[float], latencies: list[float], threshold_s: float) -> float:
    """The highest rate whose normalized latency stays under ``threshold_s`` (0 if none does).

    Rates are scanned upwards and the scan stops at the first violation: beyond the knee of the
    curve latency grows without bound, and a lucky point above it is not "sustained".
    """
    best = 0.0
    for rate, latency in sorted(zip(rates, latencies)):
        if not latency <= threshold_s:
            break
        best = rate
    return best
