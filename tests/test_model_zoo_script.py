"""benchmarks/model_zoo.py without llama.cpp: the order the engines run in, and which ratio a bar reads."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.fixture(scope="module")
def zoo():
    path = os.path.join(ROOT, "benchmarks", "model_zoo.py")
    spec = importlib.util.spec_from_file_location("model_zoo_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


class RecordingEngine:
    """Stands in for an engine process: notes each call in the shared log and answers fixed rates."""

    def __init__(self, name: str, log: list[str], decode: float) -> None:
        self.name, self.log, self.decode = name, log, decode

    def memory(self) -> dict[str, int]:
        return {"VmHWM": 2**30}

    def batch(self, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
        return {"elapsed": 1.0, "tokens": len(prompts) * max_tokens}

    def close(self) -> None:
        self.log.append(f"{self.name} close")


def run_measure(zoo, monkeypatch, interleaved: bool, streams: bool) -> tuple[list[str], object]:
    log: list[str] = []
    ours_rates = iter([(10.0, 100.0), (12.0, 120.0), (11.0, 110.0)])
    llama_rates = iter([(10.0, 50.0), (8.0, 60.0), (11.0, 55.0)])
    server = RecordingEngine("server", log, 0.0)
    ours = RecordingEngine("ours", log, 0.0)

    def llamacpp_round(args, path):
        log.append("llama-bench")
        return next(llama_rates)

    def ours_round(engine, r):
        log.append(f"ours {r}")
        return next(ours_rates)

    def streams_round(engine, r):
        log.append(f"{engine.name} streams {r}")
        return (20.0, 30.0) if engine is ours else (10.0, 20.0)

    def open_ours(args, path, row):
        log.append("ours open")
        row.ours["load_s"] = 1.0
        return ours

    def open_server(args, path, row):
        log.append("server open")
        row.llamacpp["load_s"] = 2.0
        return server

    bandwidths = iter([100.0, 300.0, 100.0, 300.0])  # bytes/s: every repeat's mean of its two probes is 200

    def measure_read_bandwidth(threads, repeats):
        log.append("probe")
        return next(bandwidths)

    for name, fn in [("llamacpp_round", llamacpp_round), ("ours_round", ours_round), ("streams_round", streams_round),
                     ("open_ours", open_ours), ("open_server", open_server),
                     ("measure_read_bandwidth", measure_read_bandwidth), ("weight_bytes_per_token", lambda path: 10)]:
        monkeypatch.setattr(zoo, name, fn)
    row = zoo.Row("m:q4_k_m", "/nonexistent.gguf", 1.0, interleaved=interleaved)
    args = argparse.Namespace(repeats=3, no_streams=not streams, threads=2)
    zoo.measure_short(args, row.path, row)
    return log, row


def test_interleaved_repeats_alternate_engines_with_ours_loaded(zoo, monkeypatch):
    log, row = run_measure(zoo, monkeypatch, interleaved=True, streams=True)
    assert log[:11] == ["ours open", "probe", "llama-bench", "ours 0", "probe", "llama-bench", "ours 1", "probe",
                        "llama-bench", "ours 2", "probe"]
    assert log[11:] == ["server open", "server streams 0", "ours streams 0", "server streams 1", "ours streams 1",
                       "server streams 2", "ours streams 2", "server close", "ours close"]
    # Medians per engine, and the median of each repeat's ours / llama.cpp (1.0, 1.5, 1.0).
    assert row.ours["decode_tok_s"] == 11.0 and row.llamacpp["decode_tok_s"] == 10.0
    assert row.ours["decode_paired_ratio"] == 1.0
    assert row.ours["decode_runs"] == [10.0, 12.0, 11.0]
    verdicts = {what: value for what, value, _, _ in zoo.verdicts(row)}
    assert verdicts["decode / llama.cpp"] == 1.0  # the paired ratio, not 11 / 10
    assert verdicts["16 streams / llama-server"] == 2.0
    # Each repeat's decode over its own roofline (10 bytes a token, 200 bytes/s): llama.cpp's 0.5, 0.4, 0.55;
    # ours 0.5, 0.6, 0.55.
    assert row.llamacpp["decode_roofline_share"] == pytest.approx(0.5)
    assert verdicts["decode / roofline"] == pytest.approx(0.55)
    assert row.ours["peak_rss_gib"] == 1.0 and row.llamacpp["peak_rss_gib"] == 1.0


def test_sequential_windows_hold_one_engine_at_a_time(zoo, monkeypatch):
    log, row = run_measure(zoo, monkeypatch, interleaved=False, streams=True)
    assert log == ["llama-bench", "llama-bench", "llama-bench", "ours open", "ours 0", "ours 1", "ours 2",
                   "ours streams 0", "ours streams 1", "ours streams 2", "ours close", "server open",
                   "server streams 0", "server streams 1", "server streams 2", "server close"]
    verdicts = {what: value for what, value, _, _ in zoo.verdicts(row)}
    assert verdicts["decode / llama.cpp"] == pytest.approx(11.0 / 10.0)  # the windows apart: medians' ratio


def test_no_streams_skips_the_server(zoo, monkeypatch):
    log, row = run_measure(zoo, monkeypatch, interleaved=True, streams=False)
    assert "server open" not in log and log[-1] == "ours close"
    assert "streams16_tok_s" not in row.ours
