#!/usr/bin/env bash
# scripts/gpu_check.sh: everything a GPU machine should verify, in one command, the first time one is lent.
# Builds the real CUDA backend (nvcc, sm_90a/sm_100a) into build-gpu/, runs the C unit tests and the
# whole Lua suite (the tests/test_cuda*.lua files run on the GPU, not emulated), then
# scripts/bench_cuda.lua and scripts/bench_blocks.lua beside PyTorch, and writes what it saw under
# experiments/bench/ with the device and date in the names and inside:
#   gpu_check_<gpu>_<date>.md   build, test counts, every failing case, the logs' tails
#   cuda_<gpu>_<date>.md        bench_cuda's tables (quantization GB/s, GEMM TFLOP/s vs PyTorch)
#   blocks_<gpu>_<date>.md      bench_blocks' table (Llama 3 8B blocks, step ms vs PyTorch)
# and copies them to $OUT when that is set (the device tool's folder that comes back).
#
# A GPU machine has CUDA, cmake, a C compiler and PyTorch but maybe no Lua, OpenBLAS or package
# registry, so the Debian packages the build needs travel as .deb files:
#   scripts/gpu_check.sh fetch     # here, with apt: .deb files into .deps/debs (git-ignored, ~13 MB)
#   scripts/gpu_check.sh [all]     # there: build, test, bench (unpacks .deps/debs into .deps/root first)
# With this workplace's device tool: run scripts/gpu_check.sh with carry [".deps/debs"] (not .deps: the
# unpacked root is ~100 MB); the tables come back through $OUT.
#   scripts/gpu_check.sh build|test|bench   # one phase (each needs the build; a 10-minute limit fits each)
# Options through the environment: GPU_CHECK_BENCH_ARGS (extra key=value for both benchmarks, e.g.
# "torch=false"), GPU_CHECK_JOBS (build parallelism, default nproc), GPU_CHECK_USE_DEBS=1 (build against
# .deps/debs even where the system has the packages: how this script is tested on a machine without a GPU),
# GPU_CHECK_TESTS (names for tests/run.lua, e.g. "cuda cuda_quant": a subset; default every file),
# GPU_CHECK_TIMEOUT (seconds for each test or benchmark program, default none: under a lease's per-call
# limit a program that runs over is stopped, the report still written and the stop named in it).
# Exit status: 0 when the build and every test passed (benchmarks only report), 1 otherwise.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
phase=${1:-all}
deps="$root/.deps"
build="$root/build-gpu"
pkgs=(liblua5.4-0 liblua5.4-dev lua-filesystem-dev lua-cjson-dev libopenblas0-openmp libopenblas-openmp-dev
      libopenblas-dev libgfortran5)

die() { echo "gpu_check: $*" >&2; exit 1; }

fetch() {
  command -v apt-get >/dev/null || die "fetch needs apt-get (run it on a Debian or Ubuntu machine with a registry)"
  mkdir -p "$deps/debs"
  (cd "$deps/debs" && rm -f ./*.deb && apt-get download "${pkgs[@]}") || die "apt-get download failed"
  echo "gpu_check: $(ls "$deps/debs" | wc -l) packages in .deps/debs ($(du -sh "$deps/debs" | cut -f1)); carry .deps"
}

# the .deb files unpacked into .deps/root unless the system has what the build needs
unpack() {
  if [ -z "${GPU_CHECK_USE_DEBS:-}" ] && [ -f /usr/include/lua5.4/lua.h ] &&
     [ -d /usr/lib/x86_64-linux-gnu/openblas-openmp ]; then return 0; fi
  [ -d "$deps/debs" ] || die "no Lua/OpenBLAS on this machine and no .deps/debs: run 'scripts/gpu_check.sh fetch' \
where apt works and bring .deps along"
  if [ ! -f "$deps/root/.unpacked" ]; then
    rm -rf "$deps/root"
    for f in "$deps"/debs/*.deb; do dpkg -x "$f" "$deps/root" || die "dpkg -x $f failed"; done
    touch "$deps/root/.unpacked"
  fi
  depsroot="$deps/root"
}

gpu_name() { nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1; }
slug() { echo "$1" | tr 'A-Z' 'a-z' | sed -E 's/nvidia //; s/[^a-z0-9]+/_/g; s/^_|_$//g' | cut -d_ -f1; }

depsroot=""
# run "$@" under GPU_CHECK_TIMEOUT when set; a stop by it is named in the log (the first argument) and returns 124
bounded() {
  local log=$1; shift
  local rc=0
  if [ -n "${GPU_CHECK_TIMEOUT:-}" ]; then timeout "$GPU_CHECK_TIMEOUT" "$@" || rc=$?; else "$@" || rc=$?; fi
  [ $rc -eq 124 ] && echo "TIMEOUT: stopped after ${GPU_CHECK_TIMEOUT}s (GPU_CHECK_TIMEOUT)" >>"$log"
  return $rc
}

env_for_run() {
  if [ -n "$depsroot" ]; then
    export LD_LIBRARY_PATH="$depsroot/usr/lib/x86_64-linux-gnu:$depsroot/usr/lib/x86_64-linux-gnu/openblas-openmp\
${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
}

do_build() {
  command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || die "no nvcc: this is for a machine with CUDA"
  [ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"
  mkdir -p "$build"
  echo "gpu_check: configuring and building $build (CUDA ON)"
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DNVLUA_CUDA=ON -DNVLUA_MPI=OFF \
    ${depsroot:+-DNVLUA_DEPS_ROOT="$depsroot"} >"$build/configure.log" 2>&1 ||
    { tail -30 "$build/configure.log"; return 1; }
  cmake --build "$build" -j"${GPU_CHECK_JOBS:-$(nproc)}" >"$build/build.log" 2>&1 ||
    { grep -E "error|Error" "$build/build.log" | head -40; return 1; }
  grep -q "CUDA backend ON" "$build/configure.log" || { grep "nvlua:" "$build/configure.log"; return 1; }
}

do_test() {
  [ -x "$build/nvlua" ] || die "no $build/nvlua: run the build phase first"
  env_for_run
  local rc=0
  echo "gpu_check: C unit tests"
  bounded "$build/unit.log" "$build/nvlua_unit" >"$build/unit.log" 2>&1 || rc=1
  tail -1 "$build/unit.log"
  echo "gpu_check: Lua suite (CUDA files on the GPU)"
  # shellcheck disable=SC2086
  bounded "$build/lua.log" "$build/nvlua" tests/run.lua ${GPU_CHECK_TESTS:-} >"$build/lua.log" 2>&1 || rc=1
  tail -1 "$build/lua.log"
  return $rc
}

do_bench() {
  [ -x "$build/nvlua" ] || die "no $build/nvlua: run the build phase first"
  env_for_run
  # shellcheck disable=SC2086
  bounded "$build/bench_cuda.err" "$build/nvlua" scripts/bench_cuda.lua ${GPU_CHECK_BENCH_ARGS:-} \
    >"$build/bench_cuda.md" 2>"$build/bench_cuda.err"
  echo "gpu_check: bench_cuda exit $?"
  # shellcheck disable=SC2086
  bounded "$build/bench_blocks.err" "$build/nvlua" scripts/bench_blocks.lua ${GPU_CHECK_BENCH_ARGS:-} \
    >"$build/bench_blocks.md" 2>"$build/bench_blocks.err"
  echo "gpu_check: bench_blocks exit $?"
}

# experiments/bench/*_<gpu>_<date>.md from the logs of the phases that ran; copies to $OUT
report() {
  local name gpu date out dest ran
  name=$(gpu_name); gpu=$(slug "${name:-unknown}"); date=$(date -u +%Y-%m-%d)
  # without a GPU (a dry run of this script) nothing goes under experiments/: there is nothing to commit
  dest=experiments/bench
  ran="The tests ran on the GPU: the real CUDA backend, not the emulation."
  if [ -z "$name" ]; then dest="$build"; ran="NO GPU was visible: every CUDA test skipped; nothing here is a GPU result."; fi
  mkdir -p "$dest"
  out="$dest/gpu_check_${gpu}_${date}.md"
  {
    echo "# scripts/gpu_check.sh on ${name:-no GPU}, $date (UTC)"
    echo
    echo "Commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'); nvcc $(nvcc --version 2>/dev/null | tail -1);"
    echo "driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 || echo none)."
    echo "Build: $1. $ran"
    echo
    for log in unit lua; do
      [ -f "$build/$log.log" ] || continue
      echo "## $log tests: $(tail -1 "$build/$log.log")"
      echo
      echo '```'
      grep -A4 "^FAIL" "$build/$log.log" | head -80
      grep "^skip" "$build/$log.log" | head -60
      grep "^TIMEOUT" "$build/$log.log"
      echo '```'
      echo
    done
  } >"$out"
  local files=("$out")
  if [ -s "$build/bench_cuda.md" ]; then
    cp "$build/bench_cuda.md" "$dest/cuda_${gpu}_${date}.md"; files+=("$dest/cuda_${gpu}_${date}.md")
  fi
  if [ -s "$build/bench_blocks.md" ]; then
    cp "$build/bench_blocks.md" "$dest/blocks_${gpu}_${date}.md"
    files+=("$dest/blocks_${gpu}_${date}.md")
  fi
  if [ -n "${OUT:-}" ]; then
    cp "${files[@]}" "$OUT/"
    # at most 8 files come back: the 3 tables and 5 logs (the build's only when it failed)
    local logs=(unit.log lua.log bench_cuda.err bench_blocks.err)
    [ "$1" = OK ] || logs+=(build.log)
    for log in "${logs[@]}"; do
      [ -f "$build/$log" ] && tail -c 2000000 "$build/$log" >"$OUT/$log"
    done
  fi
  echo "gpu_check: wrote ${files[*]}"
}

case "$phase" in
  fetch) fetch; exit 0 ;;
  build | test | bench | all) ;;
  *) die "unknown phase '$phase' (fetch, build, test, bench or all)" ;;
esac
[ -n "$(gpu_name)" ] || echo "gpu_check: warning: nvidia-smi sees no GPU; the CUDA tests will skip" >&2
unpack
status=0
built="not run in this call"
if [ "$phase" = build ] || [ "$phase" = all ]; then
  if do_build; then built="OK"; else built="FAILED (build-gpu/build.log)"; status=1; fi
fi
if [ $status -eq 0 ] && { [ "$phase" = test ] || [ "$phase" = all ]; }; then do_test || status=1; fi
# the benchmarks run after failing tests too (a first run on a new GPU wants both); not after a failed build
if [ "${built#FAILED}" = "$built" ] && { [ "$phase" = bench ] || [ "$phase" = all ]; }; then do_bench; fi
report "$built"
exit $status
