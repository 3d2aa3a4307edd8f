#!/usr/bin/env bash
# scripts/gpu_check.sh: what a GPU machine should verify, in one command that fits one 10-minute call of
# the device tool (H100/H200, 16 cores). Phases, in this order, each writing its files as it goes:
#   build      cmake + nvcc into build-gpu/ (MPI and oneDNN off; the Debian packages come as .deb files)
#   test       the C unit tests, then each tests/test_cuda*.lua file on the GPU with NVLUA_CUDA_SYNC=1 (a
#              kernel fault is reported by the launch that made it); then, where compute-sanitizer works
#              (a probe: Firecracker machines yes, gVisor no, skipped with a note), the same files again
#              under its memcheck for as long as the phase's time lasts
#   attention  scripts/bench_attention.lua (attention forward + backward at the 8B shapes beside PyTorch
#              SDPA; its markdown on stdout, exit 77 without a GPU), skipped with a note if it does not exist
#   blocks     scripts/bench_blocks.lua layers=1 (bf16, fp8_cs, nvfp4, PyTorch eager and compile; each row
#              printed when measured)
# Time: GPU_CHECK_BUDGET seconds in all (default 540: a 600 s call with a minute to spare). The build may
# take all but the last 120 s; after it each phase gets its share of what is left (test 50, attention 15,
# blocks 35), so what one leaves goes to the next; a program still running at its phase's end is stopped
# and the report says so. GPU_CHECK_TIMEOUT (seconds) caps each program further.
# Files, in $OUT when set (the device tool's folder that comes back: 8 files at most) else in
# build-gpu/gpu_check/, rewritten after every step so a call cut short still returns what finished:
#   gpu_check_<gpu>_<date>.md   the report: build (and which SASS/PTX it holds), phase times, test counts,
#                               failing cases, memcheck, benchmark status
#   unit.log, lua.log           the tests' output (lua.log: every file, then memcheck's runs)
#   attention_<gpu>_<date>.md, bench_attention.err, blocks_<gpu>_<date>.md, bench_blocks.err
#   build.log                   only when the build failed
# With a GPU the tables are copied under experiments/bench/ too (to commit); without one nothing goes there.
#
# A GPU machine has CUDA, cmake, a C compiler and PyTorch but maybe no Lua, OpenBLAS or package registry:
#   scripts/gpu_check.sh fetch     # here, with apt: .deb files into .deps/debs (git-ignored, ~13 MB)
#   scripts/gpu_check.sh [all]     # there: build, test, attention, blocks (unpacks .deps/debs first)
# With this workplace's device tool: run scripts/gpu_check.sh with carry [".deps/debs"] and timeout_s 600.
#   scripts/gpu_check.sh build|test|attention|blocks|bench|bench_cuda   # one phase (bench: attention and
#   blocks; bench_cuda: scripts/bench_cuda.lua, quantization and GEMMs beside PyTorch, not part of all;
#   probe: scripts/probe_attention_bounds.lua, the fused attention kernels' errors against the test bounds,
#   not part of all)
# Environment: GPU_CHECK_BUDGET, GPU_CHECK_TIMEOUT (above); GPU_CHECK_TESTS (names for tests/run.lua, default
# every tests/test_cuda*.lua); GPU_CHECK_MEMCHECK=0 (no compute-sanitizer); GPU_CHECK_BENCH_ARGS (extra
# key=value for bench_blocks and bench_cuda, e.g. "torch=false"); GPU_CHECK_ATTN_ARGS (for bench_attention);
# GPU_CHECK_JOBS (build parallelism, default nproc); GPU_CHECK_USE_DEBS=1 (build against .deps/debs even
# where the system has the packages: how this script is tested on a machine without a GPU).
# Exit status: 0 when the build and every test passed (benchmarks and memcheck only report), 1 otherwise.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 1
phase=${1:-all}
deps="$root/.deps"
build="$root/build-gpu"
res="${OUT:-$build/gpu_check}"
budget=${GPU_CHECK_BUDGET:-540}
start=$(date +%s)
pkgs=(liblua5.4-0 liblua5.4-dev lua-filesystem-dev lua-cjson-dev libopenblas0-openmp libopenblas-openmp-dev
      libopenblas-dev libgfortran5 libpcre2-dev libpcre2-8-0 libutf8proc-dev libutf8proc2)

pkgs+=(zlib1g zlib1g-dev) # core.gunzip (lua/bind/gzip.c): evaluation's gzip'd requests

die() { echo "gpu_check: $*" >&2; exit 1; }

fetch() {
  command -v apt-get >/dev/null || die "fetch needs apt-get (run it on a Debian or Ubuntu machine with a registry)"
  mkdir -p "$deps/debs"
  (cd "$deps/debs" && rm -f ./*.deb && apt-get download "${pkgs[@]}") || die "apt-get download failed"
  echo "gpu_check: $(ls "$deps/debs" | wc -l) packages in .deps/debs ($(du -sh "$deps/debs" | cut -f1)); carry .deps/debs"
}

case "$phase" in
  fetch) fetch; exit 0 ;;
  all) phases=(build test attention blocks) ;;
  bench) phases=(attention blocks) ;;
  build | test | attention | blocks | bench_cuda | probe) phases=("$phase") ;;
  *) die "unknown phase '$phase' (fetch, build, test, attention, blocks, bench, bench_cuda, probe or all)" ;;
esac

# the .deb files unpacked into .deps/root unless the system has what the build needs
depsroot=""
unpack() {
  if [ -z "${GPU_CHECK_USE_DEBS:-}" ] && [ -f /usr/include/lua5.4/lua.h ] &&
     [ -d /usr/lib/x86_64-linux-gnu/openblas-openmp ] && [ -f /usr/include/pcre2.h ] &&
     [ -f /usr/include/utf8proc.h ] && [ -f /usr/include/zlib.h ]; then return 0; fi
  [ -d "$deps/debs" ] || die "no Lua/OpenBLAS on this machine and no .deps/debs: run 'scripts/gpu_check.sh fetch' \
where apt works and bring .deps/debs along"
  if [ ! -f "$deps/root/.unpacked" ]; then
    rm -rf "$deps/root"
    for f in "$deps"/debs/*.deb; do dpkg -x "$f" "$deps/root" || die "dpkg -x $f failed"; done
    touch "$deps/root/.unpacked"
  fi
  depsroot="$deps/root"
  export LD_LIBRARY_PATH="$depsroot/usr/lib/x86_64-linux-gnu:$depsroot/usr/lib/x86_64-linux-gnu/openblas-openmp\
${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

gpu_name() { nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1; }
slug() { echo "$1" | tr 'A-Z' 'a-z' | sed -E 's/nvidia //; s/[^a-z0-9]+/_/g; s/^_|_$//g' | cut -d_ -f1; }
name=$(gpu_name)
gpu=$(slug "${name:-unknown}")
date=$(date -u +%Y-%m-%d)
report_md="$res/gpu_check_${gpu}_${date}.md"
attn_md="$res/attention_${gpu}_${date}.md"
blocks_md="$res/blocks_${gpu}_${date}.md"
cuda_md="$res/cuda_${gpu}_${date}.md"
probe_md="$res/attention_bounds_${gpu}_${date}.md"

now() { date +%s; }
left() { echo $((start + budget - $(now))); }

# A phase's seconds: its weight over the weights of the phases from it to the last this call runs,
# times what is left of the budget (the build: all of it but 120 s).
declare -A weight=([test]=50 [attention]=15 [blocks]=35 [bench_cuda]=35 [probe]=15)
share() {
  local p=$1 w=0 seen=0 s
  if [ "$p" = build ]; then s=$(($(left) - 120)); else
    for q in "${phases[@]}"; do
      [ "$q" = "$p" ] && seen=1
      [ $seen -eq 1 ] && [ "$q" != build ] && w=$((w + weight[$q]))
    done
    s=$(($(left) * weight[$p] / w))
  fi
  [ $s -lt 1 ] && s=1
  echo $s
}

# run "$@" until the epoch second $1 (and for at most GPU_CHECK_TIMEOUT); 124 when stopped
until_s() {
  local end=$1 s; shift
  s=$((end - $(now)))
  [ -n "${GPU_CHECK_TIMEOUT:-}" ] && [ "$GPU_CHECK_TIMEOUT" -lt $s ] && s=$GPU_CHECK_TIMEOUT
  [ $s -lt 1 ] && return 124
  timeout -k 5 "$s" "$@"
}

# What each phase did, for the report: rows "| phase | given s | took s | result |".
declare -a rows=()
row() { rows+=("| $1 | $2 | $3 | $4 |"); }
built="not run in this call"
build_s=""
san_note="not run"

commit() {
  local c
  c=$(git rev-parse --short HEAD 2>/dev/null) || { echo "? (no git here)"; return; }
  git diff --quiet HEAD 2>/dev/null && echo "$c" || echo "$c with changes"
}

# The report (rewritten after every step) and, with a GPU, the tables under experiments/bench/.
report() {
  mkdir -p "$res"
  {
    echo "# scripts/gpu_check.sh on ${name:-no GPU}, $date (UTC)"
    echo
    echo "Commit $(commit);" \
      "nvcc $(nvcc --version 2>/dev/null | tail -1); driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 || echo none);" \
      "$(nproc) cores. Phases: ${phases[*]}; budget ${budget} s, $(($(now) - start)) s used so far."
    if [ -n "$name" ]; then echo "The tests ran on the GPU: the real CUDA backend, not the emulation."
    else echo "NO GPU was visible: every CUDA test skipped; nothing here is a GPU result."; fi
    echo
    echo "Build: $built${build_s:+ in $build_s s}."
    local cod
    cod=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
    if [ -x "$build/nvlua" ] && [ -x "$cod" ]; then
      echo "Device code in build-gpu/nvlua (cuobjdump, files per target): SASS $("$cod" --list-elf "$build/nvlua" \
        2>/dev/null | grep -o 'sm_[0-9a-z]*' | sort | uniq -c | awk '{printf "%s%s x%s", s, $2, $1; s=", "}'); PTX \
$("$cod" --list-ptx "$build/nvlua" 2>/dev/null | grep -o 'sm_[0-9a-z]*' | sed 's/^sm_/compute_/' | sort | uniq -c |
        awk '{printf "%s%s x%s", s, $2, $1; s=", "}')."
    fi
    echo
    echo "| phase | given s | took s | result |"
    echo "|---|---:|---:|---|"
    printf '%s\n' "${rows[@]}"
    echo
    if [ -f "$res/unit.log" ]; then
      echo "## C unit tests: $(grep -E 'passed, [0-9]+ failed' "$res/unit.log" | tail -1)"
      echo
      echo '```'
      grep -A4 "^FAIL" "$res/unit.log" | head -40
      grep "^TIMEOUT" "$res/unit.log"
      echo '```'
      echo
    fi
    if [ -f "$res/lua.log" ]; then
      echo "## CUDA test files (NVLUA_CUDA_SYNC=1): $lua_sum"
      echo
      echo '```'
      grep -E "^-- |^TIMEOUT|^NOT RUN" "$res/lua.log" | grep -v "^-- memcheck" | head -40
      grep -A4 "^FAIL" "$res/lua.log" | head -80
      grep "^skip" "$res/lua.log" | head -40
      echo '```'
      echo
      echo "## compute-sanitizer memcheck: $san_note"
      echo
      if grep -q "^== memcheck" "$res/lua.log"; then
        echo '```'
        grep -E "^-- memcheck|^TIMEOUT: memcheck" "$res/lua.log" | head -40
        grep -E "^========= (Invalid|Uninitialized|Program hit|Address)" "$res/lua.log" | sort | uniq -c | head -20
        echo '```'
        echo
      fi
    fi
  } >"$report_md"
  if [ -n "$name" ]; then
    mkdir -p experiments/bench
    local f
    for f in "$report_md" "$attn_md" "$blocks_md" "$cuda_md" "$probe_md"; do
      [ -s "$f" ] && [ "$(dirname "$f")" != "$root/experiments/bench" ] && cp "$f" experiments/bench/
    done
  fi
}

do_build() {
  local t0 end rc=0
  t0=$(now)
  end=$((t0 + $(share build)))
  command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || die "no nvcc: this is for a machine with CUDA"
  [ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"
  mkdir -p "$build"
  echo "gpu_check: configuring and building $build (CUDA ON, MPI and oneDNN off), until $((end - t0)) s"
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DNVLUA_CUDA=ON -DNVLUA_MPI=OFF -DNVLUA_DNNL=OFF \
    ${depsroot:+-DNVLUA_DEPS_ROOT="$depsroot"} >"$build/build.log" 2>&1 &&
    grep -q "CUDA backend ON" "$build/build.log" &&
    until_s "$end" cmake --build "$build" -j"${GPU_CHECK_JOBS:-$(nproc)}" >>"$build/build.log" 2>&1 || rc=$?
  build_s=$(($(now) - t0))
  if [ $rc -eq 0 ]; then
    built="OK"
  else
    [ $rc -eq 124 ] && built="STOPPED after $((end - t0)) s (all of the budget but 120 s)" || built="FAILED"
    built="$built (build.log)"
    grep -E "error|Error|nvlua:" "$build/build.log" | head -40
    mkdir -p "$res" && tail -c 2000000 "$build/build.log" >"$res/build.log"
  fi
  row build "$((end - t0))" "$build_s" "$built"
  report
  [ $rc -eq 0 ]
}

# Does compute-sanitizer's memcheck run a CUDA program here? (gVisor: "Device not supported")
memcheck_works() {
  [ "${GPU_CHECK_MEMCHECK:-1}" = 0 ] && { san_note="off (GPU_CHECK_MEMCHECK=0)"; return 1; }
  [ -n "$name" ] || { san_note="not run: no GPU"; return 1; }
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  [ -x "$cs" ] || { san_note="not run: compute-sanitizer not found"; return 1; }
  local out rc=0
  out=$(timeout -k 5 60 "$cs" --tool memcheck --error-exitcode 86 "$build/nvlua" -e \
    'local nv = require "nvlua"; local x = nv.randn(4096):cuda(); assert((x + x):cpu():sum() == (x:cpu() * 2):sum())' 2>&1) ||
    rc=$?
  if [ $rc -ne 0 ] || ! grep -q "ERROR SUMMARY: 0 errors" <<<"$out"; then
    san_note="not run: compute-sanitizer did not run a CUDA program here (on gVisor machines it answers 'Device not supported'); its probe exited $rc: $(grep -m2 -v '^$' <<<"$out" | tr '\n' ' ' | cut -c1-300)"
    return 1
  fi
  return 0
}

lua_sum="not run"
do_test() {
  [ -x "$build/nvlua" ] || die "no $build/nvlua: run the build phase first"
  local t0 end rc=0 f out p=0 fl=0 sk=0 nfiles=0 timeouts=0
  t0=$(now)
  end=$((t0 + $(share test)))
  mkdir -p "$res"
  echo "gpu_check: C unit tests, then the CUDA test files, until $((end - t0)) s"
  local urc=0
  until_s "$end" env NVLUA_CUDA_SYNC=1 "$build/nvlua_unit" >"$res/unit.log" 2>&1 || urc=$?
  [ $urc -eq 124 ] && echo "TIMEOUT: the C unit tests stopped at their time limit (the phase's end or GPU_CHECK_TIMEOUT)" >>"$res/unit.log"
  [ $urc -ne 0 ] && rc=1
  tail -1 "$res/unit.log"
  local names=()
  if [ -n "${GPU_CHECK_TESTS:-}" ]; then read -ra names <<<"$GPU_CHECK_TESTS"
  else for f in tests/test_cuda*.lua; do names+=("$(basename "$f" .lua)"); done; fi
  : >"$res/lua.log"
  for f in "${names[@]}"; do
    if [ $(($(now) + 2)) -ge "$end" ]; then echo "NOT RUN: $f (the test phase's time ran out)" >>"$res/lua.log"; rc=1; continue; fi
    echo "== $f" >>"$res/lua.log"
    local frc=0 f0
    f0=$(now)
    until_s "$end" env NVLUA_CUDA_SYNC=1 "$build/nvlua" tests/run.lua "$f" >"$build/one.log" 2>&1 || frc=$?
    cat "$build/one.log" >>"$res/lua.log"
    echo "-- $f: $(grep -E '^[0-9]+ passed, [0-9]+ failed' "$build/one.log" | tail -1) (exit $frc, $(($(now) - f0)) s)" \
      >>"$res/lua.log"
    if [ $frc -eq 124 ]; then echo "TIMEOUT: $f stopped at its time limit (the phase's end or GPU_CHECK_TIMEOUT)" >>"$res/lua.log"; timeouts=$((timeouts + 1)); fi
    [ $frc -ne 0 ] && [ $frc -ne 77 ] && rc=1
    out=$(grep -E '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped' "$build/one.log" | tail -1)
    if [ -n "$out" ]; then
      read -r a _ b _ c _ <<<"$out"
      p=$((p + a)); fl=$((fl + b)); sk=$((sk + c))
    fi
    nfiles=$((nfiles + 1))
    lua_sum="$p passed, $fl failed, $sk skipped in $nfiles of ${#names[@]} files"
    [ $timeouts -gt 0 ] && lua_sum="$lua_sum ($timeouts stopped)"
    report
  done
  echo "gpu_check: $lua_sum"
  local msum=""
  if memcheck_works; then
    local clean=0 dirty=0 stopped=0
    san_note="running"
    for f in "${names[@]}"; do
      [ $(($(now) + 10)) -ge "$end" ] && break
      echo "== memcheck $f" >>"$res/lua.log"
      local frc=0
      # --report-api-errors no: NCCL's communicator set-up asks cudaFuncGetAttributes about kernels built for
      # other GPUs and handles the error itself (memcheck on an H200 reported those as errors); nvlua checks
      # every CUDA call it makes and raises on failure, so its own API errors fail the tests instead.
      until_s "$end" env NVLUA_CUDA_SYNC=1 "$cs" --tool memcheck --report-api-errors no --error-exitcode 86 \
        --print-limit 20 "$build/nvlua" \
        tests/run.lua "$f" >"$build/one.log" 2>&1 || frc=$?
      grep -E "^=========|^FAIL|passed, [0-9]+ failed" "$build/one.log" | head -200 >>"$res/lua.log"
      echo "-- memcheck $f: $(grep -c 'ERROR SUMMARY: 0 errors' "$build/one.log") process(es) clean, $(grep -cE \
        'ERROR SUMMARY: [1-9]' "$build/one.log") with errors (exit $frc)" >>"$res/lua.log"
      if [ $frc -eq 124 ]; then echo "TIMEOUT: memcheck $f stopped at its time limit" >>"$res/lua.log"; stopped=$((stopped + 1))
      elif grep -q "ERROR SUMMARY: 0 errors" "$build/one.log" && ! grep -qE "ERROR SUMMARY: [1-9]" "$build/one.log" &&
        [ $frc -ne 86 ]; then clean=$((clean + 1))
      else dirty=$((dirty + 1)); fi
      san_note="$clean files clean, $dirty with memcheck errors (or no summary), $stopped stopped, of ${#names[@]}"
      report
    done
    msum="; memcheck: $san_note"
  fi
  row test "$((end - t0))" "$(($(now) - t0))" "C: $(tail -1 "$res/unit.log" | cut -c1-60); Lua: $lua_sum$msum"
  report
  return $rc
}

# bench <phase> <script> <stdout file> <stderr file> args...: a benchmark until its phase's end
bench() {
  local ph=$1 script=$2 md=$3 err=$4 t0 end brc=0 what
  shift 4
  t0=$(now)
  end=$((t0 + $(share "$ph")))
  if [ ! -f "$script" ]; then
    row "$ph" "-" 0 "skipped: $script does not exist"
    report
    return 0
  fi
  [ -x "$build/nvlua" ] || die "no $build/nvlua: run the build phase first"
  mkdir -p "$res"
  echo "gpu_check: $script $*, until $((end - t0)) s"
  until_s "$end" "$build/nvlua" "$script" "$@" >"$md" 2>"$err" || brc=$?
  case $brc in
    0) what="$(basename "$md")" ;;
    77) what="skipped: no GPU (exit 77)"; rm -f "$md" ;;
    124) what="STOPPED at its time limit: $(basename "$md") holds the rows that finished" ;;
    *) what="exit $brc: see $(basename "$err")" ;;
  esac
  [ -s "$err" ] || rm -f "$err"
  row "$ph" "$((end - t0))" "$(($(now) - t0))" "$what"
  report
}

[ -n "$name" ] || echo "gpu_check: warning: nvidia-smi sees no GPU; the CUDA tests will skip" >&2
unpack
mkdir -p "$res"
status=0
# shellcheck disable=SC2086 # the *_ARGS variables are lists of key=value words
for ph in "${phases[@]}"; do
  case "$ph" in
    build) do_build || { status=1; break; } ;;
    test) do_test || status=1 ;;
    attention) bench attention scripts/bench_attention.lua "$attn_md" "$res/bench_attention.err" ${GPU_CHECK_ATTN_ARGS:-} ;;
    blocks) bench blocks scripts/bench_blocks.lua "$blocks_md" "$res/bench_blocks.err" layers=1 ${GPU_CHECK_BENCH_ARGS:-} ;;
    bench_cuda) bench bench_cuda scripts/bench_cuda.lua "$cuda_md" "$res/bench_cuda.err" ${GPU_CHECK_BENCH_ARGS:-} ;;
    probe) bench probe scripts/probe_attention_bounds.lua "$probe_md" "$res/probe.err" ;;
  esac
done
report
echo "gpu_check: wrote $res ($(ls "$res" | tr '\n' ' '))"
exit $status
