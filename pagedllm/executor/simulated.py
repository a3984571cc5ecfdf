"""An executor with no model: a clock advanced by a cost model, and scripted tokens.

The serving simulator, the dashboard's simulation and the tests run the engine core with it: the
scheduler, block manager and postprocess are the engine's own; only the forward pass is replaced,
its time by ``step_time(sched)`` (the simulator passes its cost model's) and its tokens by
``token_fn``. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.core.scheduler import SchedulerOutputs
from pagedllm.core.token_sink import ScriptedTokens
from pagedllm.sequence import Sequence, SequenceGroup

TokenFn = Callable[[SequenceGroup, Sequence], int]


class SimulatedExecutor:
    """``execute`` returns scripted tokens and sets ``last_step_time`` to the step's modelled
    seconds (the driver's clock adds them); ``on_execute`` sees each step first (the tests' fake KV
    cache)."""

    def __init__(
        self,
        token_fn: TokenFn = lambda group, seq: 0,
        step_time: Callable[[SchedulerOutputs], float] | None = None,
        max_model_len: int | None = None,
        on_execute: Callable[[SchedulerOutputs], None] | None = None,
    ) -> None:
        self.sink = ScriptedTokens(token_fn, max_model_len)
        self.step_time = step_time
        self.on_execute = on_execute
        self.last_step_time = 0.0

    def execute(self, sched: SchedulerOutputs) -> ScriptedTokens:
        if self.on_execute is not None:
            self.on_execute(sched)
        if sched.is_empty():  # nothing ran: no time passes
            self.last_step_time = 0.0
            return self.sink
        self.last_step_time = 0.0 if self.step_time is None else self.step_time(sched)
        return self.sink
