#!/usr/bin/env bash
# scripts/setup.sh: install what nvlua needs that this machine lacks (Debian packages), then
# configure and build into build/. Idempotent: quiet when nothing is missing, incremental builds.
#   scripts/setup.sh            # Release build, CUDA when nvcc is found
#   NVLUA_CUDA=OFF scripts/setup.sh
#   NVLUA_CUDA=EMU scripts/setup.sh   # into build-emu/: the CUDA backend on the CPU emulation of CUDA
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build="$root/build"
[ "${NVLUA_CUDA:-}" = "EMU" ] && build="$root/build-emu"

pkgs=(cmake gcc g++ make pkg-config liblua5.4-dev lua-filesystem-dev lua-cjson-dev libopenblas-openmp-dev libdnnl-dev libreadline-dev
      libpcre2-dev libutf8proc-dev
      bible-kjv gnuplot-nox openmpi-bin libopenmpi-dev)
pkgs+=(zlib1g-dev) # core.gunzip (lua/bind/gzip.c): evaluation's gzip'd requests
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# nvcc is often installed outside PATH
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi

mkdir -p "$build"
if [ ! -f "$build/CMakeCache.txt" ]; then
  echo "setup: configuring $(basename "$build")/ (CUDA: ${NVLUA_CUDA:-AUTO})"
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DNVLUA_CUDA="${NVLUA_CUDA:-AUTO}" >"$build/configure.log" 2>&1 ||
    { cat "$build/configure.log"; exit 1; }
fi
if ! cmake --build "$build" -j"$(nproc)" >"$build/build.log" 2>&1; then
  grep -E "error|Error" "$build/build.log" | head -40
  echo "setup: build failed; full log in $build/build.log" >&2
  exit 1
fi
