"""An executor with no model: a clock advanced by a cost model, and scripted tokens.

The serving simulator, the dashboard's simulation and the tests run the engine core with it: the
scheduler, block manager and update are the engine's own; only the forward pass is replaced,
its time by ``step_time(sched)`` (the simulator passes its cost model's) and its tokens by
``token_fn``. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.core.beam_step import BeamChoice, BeamStep
from pagedllm.core.scheduler import SchedulerOutputs, sampled_rows
from pagedllm.core.step_output import ModelOutput
from pagedllm.sequence import SequenceGroup

# (request, the sample's index in group.seqs once its token is appended, the sequence's length
# before it) -> the token. A prompt's extra samples are forked after the group's sequences, in order.
TokenFn = Callable[[SequenceGroup, int, int], int]


class SimulatedExecutor:
    """``execute`` returns scripted tokens and sets ``last_step_time`` to the step's modelled
    seconds (the driver's clock adds them); ``on_execute`` sees each step first (the tests' fake KV
    cache). A sequence stops as the engine's would (``Scheduler.update``: its request's ``max_tokens``,
    a stop token id); beams have nothing to rank without a model: each simply takes its next token."""

    def __init__(
        self,
        token_fn: TokenFn = lambda group, index, length: 0,
        step_time: Callable[[SchedulerOutputs], float] | None = None,
        on_execute: Callable[[SchedulerOutputs], None] | None = None,
    ) -> None:
        self.token_fn = token_fn
        self.step_time = step_time
        self.on_execute = on_execute
        self.last_step_time = 0.0

    def execute(self, sched: SchedulerOutputs) -> ModelOutput:
        if self.on_execute is not None:
            self.on_execute(sched)
        if sched.is_empty():  # nothing ran: no time passes
            self.last_step_time = 0.0
            return ModelOutput()
        self.last_step_time = 0.0 if self.step_time is None else self.step_time(sched)
        return self._scripted_rows(sched)

    def _scripted_rows(self, sched: SchedulerOutputs) -> ModelOutput:
        """A token per sampler row, in the batch's order; a beam-search group's beams each continue."""
        output = ModelOutput()
        token_ids = output.token_ids
        for group in sched.scheduled_seq_groups:
            plan = [(seq, num_rows) for seq, _, num_rows in sampled_rows(group, sched.num_scheduled_tokens) if num_rows]
            if group.sampling_params.use_beam_search and plan:
                output.beam_steps[group.request_id] = BeamStep(
                    [BeamChoice(index, self.token_fn(group, group.seqs.index(beam), beam.get_len()), 0.0, None, 0.0)
                     for index, (beam, _) in enumerate(plan)], [])
            next_fork = len(group.seqs)
            for seq, num_rows in plan:
                token_ids.append(self.token_fn(group, group.seqs.index(seq), seq.get_len()))
                for _ in range(num_rows - 1):
                    token_ids.append(self.token_fn(group, next_fork, seq.get_len()))
                    next_fork += 1
        output.logprobs = [0.0] * len(token_ids)
        output.top_logprobs = [None] * len(token_ids)
        return output
