"""Shared helpers of the paper_*.py benchmarks: output files, optional plots, the real-engine driver."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")


def write_json(name: str, data) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    print(f"wrote {path}")
    return path


def pyplot():
    """matplotlib.pyplot with a file-only backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping the PNG")
        return None
    return plt


def save_png(fig, name: str) -> None:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# ------------------------------------------------------------------------------ real engine

REAL_MAX_MODEL_LEN = 512


def real_trace(kind: str, num_requests: int, rate: float, seed: int, length_scale: float):
    """The trace for a real run on this CPU: the paper's lengths times ``length_scale``.

    Scaling (rather than clipping) keeps the shape of the length distributions, which is what
    decides how much a contiguous reservation wastes; 0.25 maps the chatbot limits (1024 in, 1024
    out) onto 256 + 256 = REAL_MAX_MODEL_LEN.
    """
    from pagedllm.simulator import make_trace

    trace = make_trace(kind, num_requests, rate, seed)
    half = REAL_MAX_MODEL_LEN // 2
    for req in trace:
        req.prompt_len = min(half, max(1, round(req.prompt_len * length_scale)))
        req.output_len = min(half, max(1, round(req.output_len * length_scale)))
    return trace



def make_real_engine(policy: str, num_kv_blocks: int, block_size: int = 16, max_model_len: int = 1024,
                     max_num_seqs: int = 64, model: str | None = None, num_threads: int | None = None,
                     kv_cache_dtype: str = "auto"):
    """An LLMEngine (default model, float32) running one of the paper's policies, with waste tracking,
    its KV cache stored as ``kv_cache_dtype`` (``num_kv_blocks`` blocks of that format).

    Warmed up with one short request (the first steps of a process pay one-off costs), after
    which the waste tracker and counters start from zero.
    """
    from pagedllm.config import EngineArgs
    from pagedllm.core.waste import WasteTracker
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.simulator.serving import POLICIES

    kv_allocation, batching = POLICIES[policy]
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model, num_kv_blocks=num_kv_blocks, block_size=block_size, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, enable_prefix_caching=False, num_threads=num_threads, dtype="float32",
        kv_allocation=kv_allocation, batching=batching, track_kv_waste=True, kv_cache_dtype=kv_cache_dtype,
    ))
    engine.add_request("warm-up", {"prompt_token_ids": list(range(100, 132))},
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.scheduler.waste_tracker = WasteTracker()
    return engine


def run_real_trace(engine, trace, vocab_low: int = 100, record_steps: bool = False) -> dict:
    """Serve a trace on the real engine in wall-clock time (Poisson arrivals), greedy, EOS ignored.

    Returns normalized latency, throughput, average batched requests, KV waste, and optionally
    (features, seconds) of every step for calibration.
    """
    import random

    from pagedllm.engine.request import EngineRequest
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.simulator.serving import step_features

    rng = random.Random(0)
    vocab = engine.model_config.hf_config.vocab_size
    bs = engine.cache_config.block_size
    scheduler = engine.scheduler
    captured: list = []
    original_schedule = scheduler.schedule

    def schedule():
        out = original_schedule()
        captured.append((step_features(out, bs), len(out.scheduled_seq_groups)))
        return out

    scheduler.schedule = schedule
    pending = sorted(trace, key=lambda r: r.arrival_time)
    arrival, finish, out_len = {}, {}, {}
    samples, batch_weighted, busy = [], 0.0, 0.0
    start = time.perf_counter()
    index = 0
    while index < len(pending) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while index < len(pending) and pending[index].arrival_time <= now:
            req = pending[index]
            index += 1
            prompt = [rng.randrange(vocab_low, vocab) for _ in range(req.prompt_len)]
            params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)
            group = engine.make_seq_group(EngineRequest(req.request_id, {"prompt_token_ids": prompt}, params))
            group.oracle_output_len = req.output_len
            engine.enqueue(group)
            arrival[req.request_id] = req.arrival_time
            out_len[req.request_id] = req.output_len
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[index].arrival_time - now))
            continue
        t0 = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t0
        features, batch = captured[-1]
        if batch:
            samples.append((features, dt))
            batch_weighted += batch * dt
            busy += dt
        if scheduler.waste_tracker is not None:
            scheduler.waste_tracker.reweight_last(dt)
        for output in outputs:
            if output.finished:
                finish[output.request_id] = time.perf_counter() - start
    scheduler.schedule = original_schedule
    done = [rid for rid in finish if rid in arrival]
    normalized = [(finish[rid] - arrival[rid]) / out_len[rid] for rid in done]
    stats = engine.get_stats()
    result = {
        "num_requests": len(done),
        "normalized_latency_s": statistics.fmean(normalized) if normalized else float("nan"),
        "throughput_req_s": len(done) / (time.perf_counter() - start),
        "avg_batched_requests": batch_weighted / busy if busy else 0.0,
        "num_preempted": stats["num_preempted"],
        "kv_waste": stats.get("kv_waste", {}),
        "simulated": False,
    }
    if record_steps:
        result["steps"] = samples
    return result
