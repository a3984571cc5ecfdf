"""Where an engine step's wall time goes, by phase (off by default; the benchmarks' --profile).

Phases, in step order:

- ``schedule``: the scheduler (admission, block allocation, preemption, copy-on-write);
- ``prepare_inputs``: the engine's per-sequence step inputs and the runner's batch tensors
  (token ids, positions, slot mapping, block tables);
- ``forward``: the model's forward pass (attention included);
- ``logits``: the LM head over the rows that sample;
- ``sample``: the sampler (penalties, greedy / random choice, logprobs);
- ``process_outputs``: appending tokens, forks, beam search bookkeeping, detokenization, stop
  checks, freeing finished sequences, building RequestOutputs.

Block swaps and copies are counted in ``prepare_inputs``. With tensor parallelism the runner's
phases happen in other processes: ``forward`` then holds the whole execution. On CUDA the timer
synchronises the device at each phase boundary, so it slows the run it measures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

PHASES = ("schedule", "prepare_inputs", "forward", "logits", "sample", "process_outputs")
# What the issue calls engine overhead: everything but the model's own arithmetic.
OVERHEAD_PHASES = ("schedule", "prepare_inputs", "sample", "process_outputs")

_OFF = nullcontext()


class StepTimer:
    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.enabled = False
        self.sync = sync
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def start(self) -> None:
        """Zero the totals and start timing."""
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.enabled = True

    def stop(self) -> None:
        self.enabled = False

    def phase(self, name: str):
        """A context manager adding the block's wall time to ``name`` (free when disabled)."""
        if not self.enabled:
            return _OFF
        return self._timed(name)

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            self.seconds[name] += time.perf_counter() - start

    def summary(self) -> dict[str, float]:
        """Seconds per phase, their total, and the overhead share (OVERHEAD_PHASES / total)."""
        total = sum(self.seconds.values())
        overhead = sum(self.seconds[name] for name in OVERHEAD_PHASES)
        return {**self.seconds, "total": total, "overhead_share": overhead / total if total else 0.0}


def format_breakdown(summary: dict[str, float], steps: int) -> str:
    """A printable table: per phase, seconds, ms per step and share of the step."""
    total = summary["total"] or 1.0
    lines = [f"{'phase':<16}{'seconds':>9}{'ms/step':>9}{'share':>8}"]
    for name in PHASES:
        seconds = summary[name]
        lines.append(f"{name:<16}{seconds:9.2f}{1000 * seconds / max(steps, 1):9.2f}{100 * seconds / total:7.1f}%")
    lines.append(f"overhead (schedule + prepare_inputs + sample + process_outputs): "
                 f"{100 * summary['overhead_share']:.1f}% of step time over {steps} steps")
    return "\n".join(lines)
