"""The per-phase step timer behind the benchmarks' --profile."""

from __future__ import annotations

from conftest import assert_no_leaks

from pagedllm import LLM, SamplingParams
from pagedllm.step_timing import OVERHEAD_PHASES, PHASES, StepTimer, format_breakdown


def test_timer_is_free_when_off_and_sums_when_on() -> None:
    timer = StepTimer()
    with timer.phase("schedule"):
        pass
    assert timer.summary()["total"] == 0.0
    synced = []
    timer = StepTimer(sync=lambda: synced.append(1))
    timer.start()
    with timer.phase("forward"):
        sum(range(10000))
    with timer.phase("sample"):
        pass
    timer.stop()
    with timer.phase("forward"):
        pass
    summary = timer.summary()
    assert summary["forward"] > 0 and len(synced) == 2
    assert summary["total"] == sum(summary[name] for name in PHASES)
    assert summary["overhead_share"] == sum(summary[name] for name in OVERHEAD_PHASES) / summary["total"]
    assert "overhead" in format_breakdown(summary, steps=1)


def test_engine_fills_every_phase(tiny_model_factory) -> None:
    llm = LLM(model=tiny_model_factory("llama"), num_kv_blocks=64, block_size=4)
    engine = llm.llm_engine
    engine.step_timer.start()
    llm.generate([[5, 6, 7], [8, 9, 10, 11]], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    engine.step_timer.stop()
    summary = engine.step_timer.summary()
    assert all(summary[name] > 0 for name in PHASES), summary
    assert 0 < summary["overhead_share"] < 1
    assert_no_leaks(llm)
