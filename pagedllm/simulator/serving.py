"""The simulated serving loop: the REAL core scheduler and block manager, a cost-model clock.

Each iteration is LLMEngine's step, the engine core's (engine/engine_core.py), with a
SimulatedExecutor in the model's place: requests whose Poisson arrival time has passed are queued,
``Scheduler.schedule()`` decides the step (any policy, sharing, preemption, chunked prompts), the
cost model turns the step's contents into seconds, the clock advances, and, when the clock reaches
the step's end, ``Scheduler.update`` does the engine's bookkeeping, every sequence that
sampled getting one token (parallel samples fork when the prompt is done, exactly as in the
engine). A request ends when its sequences reach the trace's output length. When nothing can
run, the clock jumps to the next arrival.

Data parallelism: ``SimConfig.num_replicas`` independent engines, each a full copy of the above
(hardware, KV pool, scheduler, clock), with a router policy (serving/router.py) sending each request, at its
arrival, to one of them; events of all replicas run in time order.

Results are labelled ``simulated``. Normalized latency = mean over requests of (end-to-end
latency / output length), the paper's metric.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.scheduler import Scheduler, SchedulerOutputs
from pagedllm.core.waste import CATEGORIES
from pagedllm.engine.engine_core import CoreStep, EngineCore
from pagedllm.executor.simulated import SimulatedExecutor
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.serving.router import Router, make_router
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
    max_steps: int = 2_000_000  # per replica
    # Data parallelism: independent engines, each with the whole hardware and pool above.
    num_replicas: int = 1
    router: str = "prefix"  # one of core.router.ROUTER_POLICIES


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
    num_replicas: int = 1
    router_stats: dict = field(default_factory=dict)  # the router's stats() (num_replicas > 1)

    def row(self) -> dict:
        return {k: getattr(self, k) for k in ("policy", "num_requests", "normalized_latency_s", "mean_latency_s",
                                              "throughput_req_s", "avg_batched_requests", "num_preempted",
                                              "num_ignored", "duration_s", "num_steps", "simulated")}


def step_features(out: SchedulerOutputs, block_size: int) -> StepFeatures:
    """The cost model's view of a scheduled step (call it before ``update`` advances it)."""
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


def sample_index_token(group: SequenceGroup, sample_index: int, seq_len: int) -> int:
    """A simulated token: the sample's index in its request (outputs differ per sample)."""
    return sample_index


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


class _Replica:
    """One simulated engine (scheduler, KV pool, clock); ``advance`` is one turn of the engine loop.

    A step's outputs are applied when the clock reaches the step's end, so that a request routed
    while the step runs sees the replica's load as it is then, finishing requests included.
    """

    def __init__(self, config: SimConfig, kv_allocation: str, batching: str, cost_model: CostModel) -> None:
        self.config = config
        self.cost_model = cost_model
        self.scheduler = make_scheduler(config, kv_allocation, batching)
        self.tracker = self.scheduler.waste_tracker
        self.executor = SimulatedExecutor(
            sample_index_token, lambda sched: cost_model.step_time(step_features(sched, config.block_size)))
        self.core = EngineCore(self.scheduler, self.executor)
        self.clock = 0.0
        self.blocked = False  # nothing could run: it waits for its next request
        self.inbox: list[_Request] = []  # routed here, queued at the next step boundary
        self.step_in_flight: CoreStep | None = None  # ends at self.clock
        self.live: dict[str, _Request] = {}
        self.num_steps = 0
        self.weighted_batch = 0.0
        self.busy_time = 0.0

    def load(self) -> int:
        """Requests in flight (waiting + running + swapped + routed but not yet queued)."""
        return self.scheduler.get_num_unfinished_seq_groups() + len(self.inbox)

    def deliver(self, request: _Request, now: float) -> None:
        if self.blocked:
            if self.tracker is not None:
                self.tracker.reweight_last(now - self.clock)
            self.clock = now  # idle until this request
            self.blocked = False
        self.inbox.append(request)

    def advance(self, more_arrivals: bool, done: list[_Request]) -> None:
        """Finish the step in flight, queue the inbox, schedule and time the next step."""
        scheduler = self.scheduler
        if self.step_in_flight is not None:
            for request in self.core.finish(self.step_in_flight).result.requests:
                group = request.group
                if group.is_finished():
                    request = self.live.pop(group.request_id)
                    request.finish_time = self.clock
                    done.append(request)
            self.step_in_flight = None
        if not (more_arrivals or self.inbox or scheduler.has_unfinished_seqs()):
            self.blocked = True  # finished: nothing more will come
            return
        for request in self.inbox:
            self.live[request.trace.request_id] = request
            scheduler.add_seq_group(request.group)
        self.inbox.clear()
        step = self.core.begin()
        out = step.sched
        for group in step.ignored:
            request = self.live.pop(group.request_id)
            request.finish_time = self.clock
        if out.is_empty():
            if more_arrivals or not scheduler.has_unfinished_seqs():
                self.blocked = True
            elif not out.ignored_seq_groups:
                raise RuntimeError("simulation stuck: requests wait but nothing can run")
            return
        dt = self.executor.last_step_time
        if self.tracker is not None:
            self.tracker.reweight_last(dt)
        self.clock += dt
        self.busy_time += dt
        self.num_steps += 1
        self.weighted_batch += dt * len(out.scheduled_seq_groups)
        if self.num_steps > self.config.max_steps:
            raise RuntimeError("simulation did not finish: the scheduler is stuck")
        self.step_in_flight = step


def trace_group(trace: TraceRequest, prompt: list[int], seq_id: int, block_size: int, max_len: int) -> SequenceGroup:
    """A trace request as the scheduler queues it: its prompt, and its output length as ``max_tokens``
    (cut to what ``max_len`` leaves; also the oracle policy's known length)."""
    seq = Sequence(seq_id, prompt, block_size)
    output_len = max(1, min(trace.output_len, max_len - trace.prompt_len))
    params = SamplingParams(n=trace.n, max_tokens=output_len, temperature=1.0 if trace.n > 1 else 0.0,
                            ignore_eos=True)
    group = SequenceGroup(trace.request_id, [seq], params, arrival_time=trace.arrival_time)
    group.oracle_output_len = output_len
    return group


def simulate(requests: list[TraceRequest], cost_model: CostModel, config: SimConfig,
             router: Router | None = None) -> SimResult:
    """Serve ``requests`` (sorted by arrival) with ``config.policy`` under ``cost_model``'s clock.

    With ``config.num_replicas`` > 1, that many independent engines (each with the whole
    simulated hardware and KV pool) serve the trace; ``router`` (default: ``config.router``'s)
    picks one per request at its arrival, from the replicas' loads at that moment. Events run in
    time order: an arrival is routed before any step that starts at or after it.
    """
    if config.policy not in POLICIES:
        raise ValueError(f"unknown policy {config.policy!r}: use one of {', '.join(POLICIES)}")
    if config.num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {config.num_replicas}")
    kv_allocation, batching = POLICIES[config.policy]
    replicas = [_Replica(config, kv_allocation, batching, cost_model) for _ in range(config.num_replicas)]
    router = router or make_router(config.router, config.block_size)
    bs = config.block_size
    max_len = min(config.max_model_len, config.num_gpu_blocks * bs)
    pending = sorted(requests, key=lambda r: r.arrival_time)
    done: list[_Request] = []
    next_arrival = 0
    while True:
        # The replica whose next step boundary comes first (ties: the lowest id).
        stepping = min((r for r in replicas if not r.blocked), key=lambda r: r.clock, default=None)
        next_step = stepping.clock if stepping is not None else math.inf
        if next_arrival < len(pending) and pending[next_arrival].arrival_time <= next_step:
            trace = pending[next_arrival]
            # Distinct token ids per request so that no block is shared by accident.
            prompt = [next_arrival * 7919 + i for i in range(trace.prompt_len)]
            chosen = 0
            if len(replicas) > 1:
                chosen = router.choose(prompt, {i: r.load() for i, r in enumerate(replicas)})
                router.record(chosen, prompt)
            replica = replicas[chosen]
            seq_id = replica.scheduler.next_seq_id()
            replica.deliver(_Request(trace, trace_group(trace, prompt, seq_id, bs, max_len)), trace.arrival_time)
            next_arrival += 1
            continue
        if stepping is None:
            break
        stepping.advance(next_arrival < len(pending), done)
    for replica in replicas:
        if replica.scheduler.has_unfinished_seqs():
            raise RuntimeError("simulation stuck: requests wait but nothing can run")
        assert replica.scheduler.block_manager.all_free(), "the simulation leaked KV blocks"
    clock = max(r.clock for r in replicas)
    busy_time = sum(r.busy_time for r in replicas)
    latencies = [(r.finish_time - r.trace.arrival_time) for r in done]
    normalized = [lat / r.group.sampling_params.max_tokens for lat, r in zip(latencies, done)]
    if len(replicas) == 1:
        stats = replicas[0].scheduler.get_stats()
        kv_waste = stats.get("kv_waste", {})
    else:
        stats = merge_stats([r.scheduler.get_stats() for r in replicas])
        kv_waste = merge_kv_waste([r.tracker for r in replicas])
    return SimResult(
        policy=config.policy,
        num_requests=len(done),
        duration_s=clock,
        normalized_latency_s=statistics.fmean(normalized) if normalized else math.nan,
        mean_latency_s=statistics.fmean(latencies) if latencies else math.nan,
        throughput_req_s=len(done) / clock if clock > 0 else math.nan,
        avg_batched_requests=sum(r.weighted_batch for r in replicas) / busy_time if busy_time > 0 else 0.0,
        num_steps=sum(r.num_steps for r in replicas),
        num_preempted=stats["num_preempted"],
        num_ignored=stats["num_ignored"],
        stats={k: v for k, v in stats.items() if k != "kv_waste"},
        kv_waste=kv_waste,
        num_replicas=len(replicas),
        router_stats=router.stats() if len(replicas) > 1 else {},
    )


def merge_stats(per_replica: list[dict]) -> dict:
    """Counters summed over replicas (the cluster's totals); the prefix-cache hit rate recomputed."""
    merged = {}
    for key, value in per_replica[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            merged[key] = sum(stats[key] for stats in per_replica)
    queried = merged.get("prefix_cache_queried_tokens", 0)
    if "prefix_cache_hit_rate" in merged:
        merged["prefix_cache_hit_rate"] = merged["prefix_cache_hit_tokens"] / queried if queried else 0.0
    return merged


def merge_kv_waste(trackers: list) -> dict:
    """The KV waste of one replica on average: slots per category weighted by each replica's time."""
    summaries = [(t.total_weight, t.summary()) for t in trackers if t is not None and t.total_weight > 0]
    total = sum(weight for weight, _ in summaries)
    if not summaries or total <= 0:
        return {"observations": 0}
    slots = {name: sum(w * s["slots"][name] for w, s in summaries) / total for name in CATEGORIES}
    pool = sum(w * s["pool_slots"] for w, s in summaries) / total
    used = pool - slots["free"]
    return {
        "observations": sum(s["observations"] for _, s in summaries),
        "pool_slots": pool,
        "slots": slots,
        "fraction_of_pool": {name: slots[name] / pool for name in CATEGORIES},
        "fraction_of_used": {name: (slots[name] / used if used else 0.0) for name in CATEGORIES if name != "free"},
    }


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
