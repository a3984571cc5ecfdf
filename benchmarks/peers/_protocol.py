"""The protocol between benchmarks/peers.py and a peer runner. Standard library only: it runs in the peer's venv.

A runner script (run_ENGINE.py) calls ``main(probe=..., load=..., convert=...)`` and is started as

    PEER_PYTHON run_ENGINE.py probe                     -> prints {"engine": ..., "version": ...}; exit 1 if missing
    PEER_PYTHON run_ENGINE.py convert --hf-dir DIR --out PATH --dtype D
    PEER_PYTHON run_ENGINE.py serve --model PATH --dtype D --threads N --workload FILE [--options JSON]

``serve`` loads the engine once (start-up, reported and excluded from throughput), answers
``{"ready": true, "startup_s": S}`` and then reads one JSON command a line on stdin:
``{"cmd": "run", "workload": NAME}`` runs ``FILE[NAME]`` (``{"prompts": [[id, ...]], "max_tokens": [n, ...]}``:
token-id prompts, greedy, exactly n new tokens each, EOS ignored) and answers
``{"elapsed": seconds, "token_ids": [[id, ...], ...]}`` (plus ``"stats": {...}`` when the runner's
generate function carries a ``stats`` dict, refreshed by each run: what the engine itself reports, such
as its KV cache size or the peak number of running requests); ``{"cmd": "quit"}`` ends it. Errors answer
``{"error": traceback}``. Replies go to the original stdout; everything the libraries print is sent
to stderr (vLLM logs to stdout), so a stray print can never corrupt a reply.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# generate(prompts, max_tokens) -> new token ids per prompt
Generate = Callable[[list[list[int]], list[int]], list[list[int]]]
# load(model, dtype, threads, options, workloads) -> generate
Load = Callable[[str, str, int, dict[str, Any], dict[str, Any]], Generate]


def main(probe: Callable[[], dict[str, Any]], load: Load, convert: Callable[[str, str, str], None] | None) -> int:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("probe")
    convert_parser = commands.add_parser("convert")
    convert_parser.add_argument("--hf-dir", required=True)
    convert_parser.add_argument("--out", required=True)
    convert_parser.add_argument("--dtype", default="float32")
    serve_parser = commands.add_parser("serve")
    serve_parser.add_argument("--model", required=True)
    serve_parser.add_argument("--dtype", required=True)
    serve_parser.add_argument("--threads", type=int, required=True)
    serve_parser.add_argument("--workload", required=True)
    serve_parser.add_argument("--options", default="{}")
    args = parser.parse_args()

    if args.command == "probe":
        try:
            info = probe()
        except ImportError as e:
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
            return 1
        print(json.dumps(info))
        return 0
    if args.command == "convert":
        if convert is None:
            print("this engine reads the Hugging Face folder as it is", file=sys.stderr)
            return 1
        convert(os.path.abspath(args.hf_dir), os.path.abspath(args.out), args.dtype)
        return 0
    return serve(load, args)


def serve(load: Load, args: argparse.Namespace) -> int:
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # os.dup: not inherited by the engine's own processes
    os.dup2(2, 1)

    def reply(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    with open(args.workload) as f:
        workloads = json.load(f)
    start = time.perf_counter()
    try:
        generate = load(args.model, args.dtype, args.threads, json.loads(args.options), workloads)
    except Exception:
        reply({"error": traceback.format_exc()})
        return 1
    reply({"ready": True, "startup_s": time.perf_counter() - start})
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        if command.get("cmd") == "quit":
            break
        try:
            workload = workloads[command["workload"]]
            start = time.perf_counter()
            token_ids = generate(workload["prompts"], workload["max_tokens"])
            elapsed = time.perf_counter() - start
            message: dict[str, Any] = {"elapsed": elapsed, "token_ids": [[int(t) for t in ids] for ids in token_ids]}
            stats = getattr(generate, "stats", None)
            if stats is not None:
                message["stats"] = stats
            reply(message)
        except Exception:
            reply({"error": traceback.format_exc()})
    return 0


def bin_path(name: str) -> str:
    """A console script of the running venv (``ct2-transformers-converter``, ``optimum-cli``)."""
    return os.path.join(os.path.dirname(sys.executable), name)
