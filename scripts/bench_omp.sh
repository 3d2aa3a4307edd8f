#!/usr/bin/env bash
# scripts/bench_omp.sh: how OpenMP's idle threads share cores. Runs the main job alone and two copies
# at once on the same cores, under each OpenMP wait setting, and prints the median step time of
# each (steps 3.. of metrics.jsonl) as a markdown table. Two jobs at once on N cores should cost
# about 2x one (each gets half the cores); spinning idle threads make it far worse.
#   scripts/bench_omp.sh [steps_alone] [steps_pair]       (defaults 30 and 12)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin="$root/build/nvlua"
n1=${1:-30}; n2=${2:-12}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
median() { # metrics.jsonl -> median ms of steps >= 3
  awk -F'"ms":' 'NF > 1 { split($2, a, ","); s = $0; sub(/.*"step":/, "", s); sub(/[,}].*/, "", s)
    if (s + 0 >= 3) print a[1] }' "$1" | sort -g | awk '{ v[NR] = $1 } END { printf "%.0f", v[int((NR + 1) / 2)] }'
}
run() { # name env... -> runs, sets $a (alone ms) $p (pair ms, mean of the two)
  local name=$1; shift
  env "$@" "$bin" "$root/experiments/tiny_llama_nvfp4.lua" steps="$n1" out="$tmp/$name-a" quiet=true \
    eval_every=0 sample_tokens=0 ckpt_every=0 >/dev/null
  a=$(median "$tmp/$name-a/metrics.jsonl")
  env "$@" "$bin" "$root/experiments/tiny_llama_nvfp4.lua" steps="$n2" out="$tmp/$name-p1" quiet=true \
    eval_every=0 sample_tokens=0 ckpt_every=0 >/dev/null &
  env "$@" "$bin" "$root/experiments/tiny_llama_nvfp4.lua" steps="$n2" out="$tmp/$name-p2" quiet=true \
    eval_every=0 sample_tokens=0 ckpt_every=0 >/dev/null
  wait
  local p1 p2; p1=$(median "$tmp/$name-p1/metrics.jsonl"); p2=$(median "$tmp/$name-p2/metrics.jsonl")
  p=$(( (p1 + p2) / 2 ))
}
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); $(date -u +%F)"
echo
echo "| OpenMP setting | one job, ms/step | two at once, ms/step each | two / one |"
echo "|---|---:|---:|---:|"
IFS=';' read -ra rows <<< "${SETTINGS:-libgomp default|-u OMP_WAIT_POLICY -u GOMP_SPINCOUNT;OMP_WAIT_POLICY=passive|OMP_WAIT_POLICY=passive;GOMP_SPINCOUNT=10000|GOMP_SPINCOUNT=10000;GOMP_SPINCOUNT=100000|GOMP_SPINCOUNT=100000}"
for row in "${rows[@]}"; do
  label=${row%%|*}; envs=${row#*|}
  # shellcheck disable=SC2086
  run "$(echo "$label" | tr -c 'a-zA-Z0-9' _)" $envs
  echo "| $label | $a | $p | $(awk "BEGIN { printf \"%.2fx\", $p / $a }") |"
done
