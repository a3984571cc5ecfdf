"""The engine's one step: ``schedule → executor.execute → scheduler.postprocess``.

Every driver of a scheduler runs its steps through an EngineCore: ``LLMEngine`` with the model's
executor, and the serving simulator, the dashboard's simulation and the tests' fake engine with a
``SimulatedExecutor`` (executor/simulated.py: a cost-model clock and scripted tokens). A step may be
finished at once (``step``) or kept in flight (``begin`` now, ``finish`` when its time is up: the
simulator applies a step's tokens when its clock reaches the step's end). The core decides nothing
itself and never calls back up; its callers turn the result into their outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.core.scheduler import Scheduler, SchedulerOutputs, StepResult
from pagedllm.core.token_sink import TokenSink
from pagedllm.sequence import SequenceGroup
from pagedllm.step_timing import StepTimer


class Executor(Protocol):
    """Runs one scheduled step and returns where its sampled tokens are read from."""

    def execute(self, sched: SchedulerOutputs) -> TokenSink: ...


@dataclass
class CoreStep:
    """One step: what the scheduler decided and, once finished, what ``postprocess`` did."""

    sched: SchedulerOutputs
    sink: TokenSink
    result: StepResult = field(default_factory=StepResult)

    @property
    def ignored(self) -> list[SequenceGroup]:
        """Requests the scheduler refused this step (a prompt that can never fit)."""
        return self.sched.ignored_seq_groups


class EngineCore:
    """``timer`` (step_timing.StepTimer) times the ``schedule`` and ``process_outputs`` phases; the
    executor times its own."""

    def __init__(self, scheduler: Scheduler, executor: Executor, timer: StepTimer | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.timer = timer or StepTimer()

    def begin(self) -> CoreStep:
        """Schedule and execute a step (an empty one too: the executor decides what it costs); its
        tokens are applied by ``finish``."""
        with self.timer.phase("schedule"):
            sched = self.scheduler.schedule()
        return CoreStep(sched, self.executor.execute(sched))

    def finish(self, step: CoreStep) -> CoreStep:
        """Apply the step's tokens (``Scheduler.postprocess``: appends, forks, stops, frees)."""
        with self.timer.phase("process_outputs"):
            step.result = self.scheduler.postprocess(step.sched, step.sink)
        return step

    def step(self) -> CoreStep:
        return self.finish(self.begin())
