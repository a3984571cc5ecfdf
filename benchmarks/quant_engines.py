"""The engines of benchmarks/quantized.py, seen from the orchestrating process.

``ChildEngine`` drives a runner of benchmarks/quant_runners/ (pagedllm, llama-cpp-python) in its own
process and venv through the line protocol of quant_runners/_child.py. ``LlamaServerEngine`` starts
llama.cpp's own ``llama-server`` (continuous batching, ``--parallel`` slots) and sends it concurrent
HTTP requests from a thread per stream. Both expose: ``load_s``, ``single``, ``batch``, ``memory``,
``close``; peak RSS is each engine process's own ``VmHWM``.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TextIO

RUNNERS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quant_runners")


def read_status(pid: int) -> dict[str, int]:
    """VmHWM / VmRSS / RssAnon / RssFile of a process, bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def die_with_parent() -> None:
    """preexec_fn: the engine gets SIGTERM when the orchestrator dies (a killed run leaves no server behind)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


def tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


class ChildEngine:
    def __init__(self, name: str, python: str, runner: str, model: str, threads: int, options: dict[str, Any],
                 env: dict[str, str], log_path: str) -> None:
        self.name = name
        self.log_path = log_path
        self.log: TextIO = open(log_path, "w")
        child_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        child_env.setdefault("OMP_NUM_THREADS", str(threads))
        child_env.update(env)
        command = [python, os.path.join(RUNNERS_DIR, runner), "--model", model, "--threads", str(threads),
                   "--options", json.dumps(options)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                        text=True, env=child_env, preexec_fn=die_with_parent)
        try:
            ready = self._read()
        except Exception:
            self.close()
            raise
        self.load_s = float(ready["load_s"])
        self.load_rss = {k: ready[k] for k in ("rss_before_load", "rss_after_load")}

    def _read(self) -> dict[str, Any]:
        line = self.process.stdout.readline() if self.process.stdout else ""
        if not line:
            self.process.wait()
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}; log {self.log_path}:\n"
                               + tail(self.log_path))
        message = json.loads(line)
        if "error" in message:
            raise RuntimeError(f"{self.name}: {message['error']}")
        return message

    def _ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._read()

    def single(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return self._ask({"cmd": "single", "prompt": prompt, "max_tokens": max_tokens})

    def batch(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        return self._ask({"cmd": "batch", "prompts": prompts, "max_tokens": max_tokens})

    def memory(self) -> dict[str, Any]:
        return {**self._ask({"cmd": "memory"}), **self.load_rss}

    def close(self) -> None:
        try:
            if self.process.poll() is None and self.process.stdin is not None:
                self.process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.process.stdin.flush()
                self.process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            self.process.kill()
            self.process.wait()
        self.log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServerEngine:
    """``llama-server -np PARALLEL -cb``: the KV pool is PARALLEL x ``slot_tokens`` cells, unified; the
    prompt cache in RAM (``--cache-ram``) is off so that peak RSS is weights + KV + compute buffers, and
    every request sets ``cache_prompt: false`` so no prompt is reused between runs."""

    def __init__(self, binary: str, model: str, threads: int, parallel: int, slot_tokens: int, log_path: str,
                 extra_args: list[str] | None = None, timeout_s: float = 900.0, ctx_tokens: int | None = None) -> None:
        self.name = "llama.cpp server"
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # ctx_tokens: the whole pool's size when it is set by memory (a unified cache), not by slots.
        context = ctx_tokens if ctx_tokens is not None else parallel * slot_tokens
        command = [binary, "-m", model, "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-cb",
                   "-c", str(context), "--host", "127.0.0.1", "--port", str(self.port),
                   "--cache-ram", "0", "--no-webui", *(extra_args or [])]
        start = time.perf_counter()
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        while True:  # /health answers 503 while the model loads, 200 when slots are ready
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}; log {log_path}:\n"
                                   + tail(log_path))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.perf_counter() - start > timeout_s:
                self.close()
                raise RuntimeError(f"llama-server not ready after {timeout_s:.0f} s; log {log_path}")
            time.sleep(0.1)
        self.load_s = time.perf_counter() - start

    def _complete(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        body = {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "cache_prompt": False,
                "temperature": 0.0, "top_k": 1, "samplers": ["top_k"], "stream": False}
        request = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as r:
            return json.loads(r.read())

    def single(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        reply = self._complete(prompt, max_tokens)
        timings = reply["timings"]
        # predicted_ms runs from the first new token (sampled after the prompt's pass) to the last: decode only,
        # over predicted_n - 1 steps, as (tokens - 1) / decode_s expects.
        return {"prefill_s": timings["prompt_ms"] / 1000, "decode_s": timings["predicted_ms"] / 1000,
                "tokens": int(timings["predicted_n"])}

    def batch(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            replies = list(pool.map(lambda p: self._complete(p, max_tokens), prompts))
        elapsed = time.perf_counter() - start
        return {"elapsed": elapsed, "tokens": sum(int(r["tokens_predicted"]) for r in replies)}

    def memory(self) -> dict[str, Any]:
        return read_status(self.process.pid)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
