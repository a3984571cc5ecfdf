"""The protocol between benchmarks/quantized.py and an engine runner. Standard library only: it runs in the
engine's own venv (pagedllm's .venv, llama.cpp's peer venv), one process per engine, so that the process's
peak RSS (VmHWM) is that engine's alone.

    PYTHON run_ENGINE.py --model PATH --threads N [--options JSON]

loads the engine (timed), answers ``{"ready": true, "load_s": S}`` and then reads one JSON command a line:

- ``{"cmd": "single", "prompt": [ids], "max_tokens": n}`` -> ``{"prefill_s", "decode_s", "tokens"}``:
  one stream, greedy, exactly n new tokens (EOS ignored); decode_s spans the first to the last new
  token, so decode tok/s = (tokens - 1) / decode_s.
- ``{"cmd": "batch", "prompts": [[ids], ...], "max_tokens": n}`` -> ``{"elapsed", "tokens"}``: every
  prompt submitted at once, greedy, n new tokens each; elapsed is wall time including prefill.
- ``{"cmd": "memory"}`` -> this process's ``VmHWM`` / ``VmRSS`` (bytes) plus whatever the runner adds.
- ``{"cmd": "quit"}``.

Errors answer ``{"error": traceback}``. Replies go to the original stdout; everything else that prints
goes to stderr, so library chatter can never corrupt a reply.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol


class Runner(Protocol):
    def single(self, prompt: list[int], max_tokens: int) -> dict[str, Any]: ...

    def batch(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]: ...

    def memory(self) -> dict[str, Any]: ...


def proc_status() -> dict[str, int]:
    """VmHWM (peak resident set), VmRSS and its anonymous / file-backed parts (llama.cpp mmaps the GGUF: its
    pages count as RssFile) of this process, in bytes (Linux /proc)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024  # reported in kB
    return out


def main(load: Callable[[str, int, dict[str, Any]], Runner], preload: Callable[[], None] | None = None) -> int:
    """``preload`` imports the engine's libraries before the load clock starts (load time = the model's)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--options", default="{}")
    args = parser.parse_args()

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def reply(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    if preload is not None:
        preload()
    before = proc_status()
    start = time.perf_counter()
    try:
        runner = load(args.model, args.threads, json.loads(args.options))
    except Exception:
        reply({"error": traceback.format_exc()})
        return 1
    load_s = time.perf_counter() - start
    after = proc_status()
    reply({"ready": True, "load_s": load_s, "rss_before_load": before["VmRSS"], "rss_after_load": after["VmRSS"]})
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        try:
            if command["cmd"] == "quit":
                break
            if command["cmd"] == "single":
                reply(runner.single(command["prompt"], int(command["max_tokens"])))
            elif command["cmd"] == "batch":
                reply(runner.batch(command["prompts"], int(command["max_tokens"])))
            elif command["cmd"] == "memory":
                reply({**proc_status(), **runner.memory()})
            else:
                reply({"error": f"unknown command {command['cmd']!r}"})
        except Exception:
            reply({"error": traceback.format_exc()})
    return 0
