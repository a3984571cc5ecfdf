"""The engine's one step: ``schedule → executor.execute → scheduler.update``.

Every driver of a scheduler runs its steps through an EngineCore: ``LLMEngine`` with the model's
step executor (engine/step_executor.py), and the serving simulator, the dashboard's simulation and
the tests' fake engine with a ``SimulatedExecutor`` (executor/simulated.py: a cost-model clock and
scripted tokens). A step may be finished at once (``step``) or kept in flight (``begin`` now,
``finish`` when its time is up: the simulator applies a step's tokens when its clock reaches the
step's end). The core decides nothing itself and never calls back up: ``update`` returns plain
per-request outputs (core/step_output.py) that its callers turn into theirs; the sequences the
output side ends afterwards (a stop string, a failure) come back through ``free_finished``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.core.scheduler import Scheduler, SchedulerOutputs
from pagedllm.core.step_output import ModelOutput, StepOutputs
from pagedllm.sequence import Sequence, SequenceGroup
from pagedllm.step_timing import StepTimer


class Executor(Protocol):
    """Runs one scheduled step and returns its sampled rows as plain data."""

    def execute(self, sched: SchedulerOutputs) -> ModelOutput: ...


@dataclass
class CoreStep:
    """One step: what the scheduler decided, what the executor returned and, once finished, what
    ``update`` did."""

    sched: SchedulerOutputs
    model_output: ModelOutput
    result: StepOutputs = field(default_factory=StepOutputs)

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

    def add_request(self, group: SequenceGroup) -> None:
        self.scheduler.add_seq_group(group)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish the named requests wherever they are, freeing their blocks (unknown ids are ignored)."""
        self.scheduler.abort_seq_group(request_ids)

    def free_finished(self, seqs: Iterable[Sequence]) -> None:
        """Give back the blocks of sequences finished after ``update`` (a stop string found in their
        text, a request failed alone); a group whose sequences are all finished leaves the running queue."""
        for seq in seqs:
            self.scheduler.free_seq(seq)  # a no-op for a sequence that holds no blocks
        self.scheduler.free_finished_seq_groups()

    def begin(self) -> CoreStep:
        """Schedule and execute a step (an empty one too: the executor decides what it costs); its
        tokens are applied by ``finish``."""
        with self.timer.phase("schedule"):
            sched = self.scheduler.schedule()
        return CoreStep(sched, self.executor.execute(sched))

    def finish(self, step: CoreStep) -> CoreStep:
        """Apply the step's tokens (``Scheduler.update``: appends, stop tokens and lengths, forks, beams, frees)."""
        with self.timer.phase("process_outputs"):
            step.result = self.scheduler.update(step.sched, step.model_output)
        return step

    def step(self) -> CoreStep:
        return self.finish(self.begin())
