#!/usr/bin/env bash
# scripts/test.sh: set up (scripts/setup.sh), then run the C unit tests and the Lua test suite.
# Extra arguments select Lua test files: scripts/test.sh tensor matmul
#   scripts/test.sh --sanitize [names...]: the same tests on a CPU-only build with AddressSanitizer,
#   LeakSanitizer and UndefinedBehaviorSanitizer in build-san/ (CMake option NVLUA_SANITIZE). Every
#   process the tests start (the REPL tests' nvlua, mpirun's ranks) is that binary too: they run
#   the interpreter that runs them. Reports of every process go to build-san/sanitizer-logs/; any
#   report fails the run, even one from a child whose test expected it to fail.
#   scripts/test.sh --emu [names...]: the CUDA test files (tests/test_cuda*.lua; or the names given)
#   on the CPU emulation of CUDA in build-emu/ (-DNVLUA_CUDA=EMU, kernels/cuda/emu): every CUDA kernel
#   runs on the CPU, with the rules a GPU enforces checked. Not a GPU run: results are the CPU's. The
#   full run repeats test_cuda_mor on an emulated sm_100 (NVLUA_EMU_CC=100: the native MX GEMM path).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

sanitize=0
emu=0
if [ "${1:-}" = "--sanitize" ]; then sanitize=1; shift; fi
if [ "${1:-}" = "--emu" ]; then emu=1; shift; fi

cd "$root"
bin=build
if [ $emu -eq 1 ]; then
  NVLUA_CUDA=EMU "$root/scripts/setup.sh"
  all=0
  if [ $# -eq 0 ]; then
    all=1
    for f in tests/test_cuda*.lua; do set -- "$@" "$(basename "$f" .lua)"; done
  fi
  echo "test.sh: CUDA EMULATED on the CPU (build-emu/, not a GPU): $*"
  build-emu/nvlua tests/run.lua "$@"
  if [ $all -eq 1 ]; then
    # the same devices as Blackwell's (sm_100): the native block-scaled cuBLASLt GEMMs (MXFP8 / NVFP4
    # operands, MoR's GAM MX operands) instead of their sm_90 emulation
    echo "test.sh: CUDA EMULATED as sm_100 (NVLUA_EMU_CC=100): test_cuda_mor"
    NVLUA_EMU_CC=100 build-emu/nvlua tests/run.lua test_cuda_mor
  fi
  exit 0
fi
"$root/scripts/setup.sh"
if [ $sanitize -eq 1 ]; then
  bin=build-san
  if [ ! -f "$bin/CMakeCache.txt" ]; then
    echo "test.sh: configuring $bin/ (sanitizers, CPU only)"
    # -O1: the sanitizers' usual level, fast enough for the training tests, few frames lost
    mkdir -p "$bin"
    cmake -S "$root" -B "$bin" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG="-O1 -g" -DNVLUA_CUDA=OFF \
      -DNVLUA_SANITIZE=ON >"$bin/configure.log" 2>&1 ||
      { cat "$bin/configure.log"; rm -f "$bin/CMakeCache.txt"; exit 1; }
  fi
  if ! cmake --build "$bin" -j"$(nproc)" >"$bin/build.log" 2>&1; then
    grep -E "error|Error" "$bin/build.log" | head -40
    echo "test.sh: sanitizer build failed; full log in $bin/build.log" >&2
    exit 1
  fi
  logs="$root/$bin/sanitizer-logs"
  rm -rf "$logs"
  mkdir -p "$logs"
  # allocator_may_return_null: a tensor too large for memory must give nvlua's "cannot allocate"
  # error, not ASan's abort. fast_unwind_on_malloc=0: whole allocation stacks, which the leak
  # suppressions (scripts/lsan.supp: Open MPI's own allocations) need to match.
  export ASAN_OPTIONS="log_path=$logs/asan:allocator_may_return_null=1:fast_unwind_on_malloc=0:detect_leaks=1"
  export LSAN_OPTIONS="suppressions=$root/scripts/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="log_path=$logs/ubsan:print_stacktrace=1:halt_on_error=1"
  export NVLUA_CPU_CACHE_MB=0 # no reuse of freed host buffers: every free reaches ASan
fi

c_status=0
if [ $# -eq 0 ]; then "$bin/nvlua_unit" || c_status=$?; fi
lua_status=0
"$bin/nvlua" tests/run.lua "$@" || lua_status=$?

san_status=0
if [ $sanitize -eq 1 ]; then
  # a log holds only warnings (e.g. an allocation refused under allocator_may_return_null) unless
  # it has a report
  reports=$(grep -l -E "ERROR: |runtime error|SUMMARY: " "$logs"/* 2>/dev/null || true)
  if [ -n "$reports" ]; then
    for f in $reports; do
      echo "---- sanitizer report: $f" >&2
      head -60 "$f" >&2
    done
    echo "test.sh: sanitizer reports in $(echo "$reports" | wc -l) process(es); logs in $logs" >&2
    san_status=1
  else
    echo "test.sh: no sanitizer reports"
  fi
fi
[ $c_status -eq 0 ] || { echo "C unit tests failed" >&2; exit 1; }
[ $san_status -eq 0 ] || exit 1
[ $lua_status -eq 0 ] || [ $lua_status -eq 77 ] || exit 1
