"""The simulator as a dashboard source: paper-scale pools, live, without the hardware.

``simulator.serving.simulate`` runs a whole trace to the end as fast as it can; the dashboard
needs the same loop one step at a time, paced so that simulated seconds pass as wall-clock
seconds (times ``speed``). ``SteppedSimulation`` is that loop (the engine core's step over the REAL
scheduler and block manager, with a SimulatedExecutor's cost-model clock), plus what a live picture needs and the
batch simulator does not: an optional prompt prefix shared by every request, TTFT / ITL in
simulated time, and a fresh trace whenever one is used up, so the page never goes still.

Steps and snapshots both run on the event loop, so a snapshot always falls between two steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.snapshot import take_snapshot
from pagedllm.entrypoints.dashboard.hub import DashboardHub
from pagedllm.executor.simulated import SimulatedExecutor
from pagedllm.sequence import SequenceGroup
from pagedllm.simulator import CostModel, SimConfig, TraceRequest
from pagedllm.simulator.serving import POLICIES, make_scheduler, sample_index_token, step_features, trace_group

TraceFactory = Callable[[int], list[TraceRequest]]  # round number -> requests, arrivals from 0


class SteppedSimulation:
    def __init__(self, make_trace: TraceFactory, cost_model: CostModel, config: SimConfig,
                 shared_prefix_len: int = 0) -> None:
        if config.policy not in POLICIES:
            raise ValueError(f"unknown policy {config.policy!r}: use one of {', '.join(POLICIES)}")
        kv_allocation, batching = POLICIES[config.policy]
        self.config = config
        self.cost_model = cost_model
        self.make_trace = make_trace
        self.shared_prefix_len = shared_prefix_len
        prefix_caching = config.enable_prefix_caching and kv_allocation == "paged"
        live_config = dataclasses.replace(config, track_kv_waste=False, enable_prefix_caching=prefix_caching)
        self.scheduler = make_scheduler(live_config, kv_allocation, batching)
        self.executor = SimulatedExecutor(
            sample_index_token, lambda sched: cost_model.step_time(step_features(sched, config.block_size)))
        self.core = EngineCore(self.scheduler, self.executor)
        self.max_len = min(config.max_model_len, config.num_gpu_blocks * config.block_size)
        self.clock = 0.0
        self.round = 0
        self.pending: list[TraceRequest] = []
        self.next_arrival = 0
        self.num_steps = 0
        self._first_token: dict[str, float] = {}
        self._last_token: dict[str, float] = {}
        # Called with (clock, seconds): the hub's recorders (no-ops unless someone watches).
        self.on_ttft: Callable[[float, float], None] = lambda now, seconds: None
        self.on_itl: Callable[[float, float], None] = lambda now, seconds: None
        self._load_round()

    def _load_round(self) -> None:
        offset = self.clock
        self.pending = sorted(self.make_trace(self.round), key=lambda r: r.arrival_time)
        for request in self.pending:
            request.arrival_time += offset
            request.request_id = f"r{self.round}-{request.request_id}"
        self.next_arrival = 0
        self.round += 1

    def _admit(self, trace: TraceRequest) -> None:
        bs = self.config.block_size
        prefix_len = min(self.shared_prefix_len, max(0, trace.prompt_len - 1))
        # A common prefix (same token ids) for prefix caching to find; the rest distinct per request.
        prompt = list(range(prefix_len))
        seq_id = self.scheduler.next_seq_id()
        prompt += [1_000_000 + seq_id * 7919 + i for i in range(trace.prompt_len - prefix_len)]
        self.scheduler.add_seq_group(trace_group(trace, prompt, seq_id, bs, self.max_len))

    def step(self) -> float:
        """One engine iteration (or an idle jump to the next arrival); returns simulated seconds passed."""
        if self.next_arrival >= len(self.pending) and not self.scheduler.has_unfinished_seqs():
            self._load_round()
        while self.next_arrival < len(self.pending) and self.pending[self.next_arrival].arrival_time <= self.clock:
            self._admit(self.pending[self.next_arrival])
            self.next_arrival += 1
        step = self.core.step()
        for group in step.ignored:
            self._forget(group.request_id)
        if step.sched.is_empty():
            if self.next_arrival < len(self.pending):
                gap = max(0.0, self.pending[self.next_arrival].arrival_time - self.clock)
                self.clock += gap
                return gap
            return 0.0
        dt = self.executor.last_step_time
        self.clock += dt
        self.num_steps += 1
        for group in (request.group for request in step.result.requests):
            self._token_times(group)
            if group.is_finished():
                self._forget(group.request_id)
        return dt

    def _token_times(self, group: SequenceGroup) -> None:
        request_id = group.request_id
        if request_id not in self._first_token:
            self._first_token[request_id] = self.clock
            self.on_ttft(self.clock, self.clock - group.metrics.arrival_time)
        else:
            self.on_itl(self.clock, self.clock - self._last_token[request_id])
        self._last_token[request_id] = self.clock

    def _forget(self, request_id: str) -> None:
        self._first_token.pop(request_id, None)
        self._last_token.pop(request_id, None)

    def counters(self) -> dict[str, float]:
        scheduler = self.scheduler
        return {
            "prompt_tokens": scheduler.num_prompt_tokens,
            "generation_tokens": scheduler.num_generation_tokens,
            "preemptions": scheduler.num_preempted_by_recompute + scheduler.num_preempted_by_swap,
            "steps": self.num_steps,
        }


class SimulatedSource:
    """DashboardSource over a SteppedSimulation; ``run`` paces it to the wall clock."""

    def __init__(self, simulation: SteppedSimulation, speed: float = 1.0) -> None:
        if not speed > 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        self.simulation = simulation
        self.speed = speed
        self.stopped = False

    def now(self) -> float:
        return self.simulation.clock

    def is_alive(self) -> bool:
        return not self.stopped

    async def capture(self) -> dict[str, Any]:
        sim = self.simulation
        snapshot = take_snapshot(sim.scheduler, sim.max_len)
        snapshot["counters"] = sim.counters()
        snapshot["simulated"] = True
        return snapshot

    def attach(self, hub: DashboardHub) -> None:
        self.simulation.on_ttft = hub.record_ttft
        self.simulation.on_itl = hub.record_itl

    async def run(self, max_idle_sleep_s: float = 5.0) -> None:
        """Step forever: simulated time advances at ``speed`` × wall-clock time."""
        sim = self.simulation
        wall_start, sim_start = time.monotonic(), sim.clock
        while not self.stopped:
            if sim.step() == 0.0 and not sim.scheduler.running:
                await asyncio.sleep(0.05)  # nothing can run (and no arrival pending): don't spin
                continue
            target = wall_start + (sim.clock - sim_start) / self.speed
            delay = target - time.monotonic()
            if delay > max_idle_sleep_s:  # a long gap between arrivals: skip most of it
                wall_start -= delay - max_idle_sleep_s
                delay = max_idle_sleep_s
            # Behind schedule: still yield, so snapshots and the HTTP server get their turn.
            await asyncio.sleep(max(0.0, delay))
