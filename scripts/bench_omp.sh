#!/usr/bin/env bash
# scripts/bench_omp.sh: how OpenMP's idle threads share cores. Runs the main job alone and two copies
# at once on the same cores under each OpenMP wait setting and prints, as a markdown table, the
# median step time (steps 3.. of metrics.jsonl) of each. The lone runs go round-robin over the
# settings, `reps` times, and the table shows the median of the reps, so a slow minute of a shared
# machine hits every setting alike. Two jobs on N cores should cost about 2x one (each gets half the
# cores); idle threads that spin make it far worse.
#   scripts/bench_omp.sh [steps_alone=30] [steps_pair=8] [reps=3]
#   SETTINGS="label|env args;..." overrides the rows (env(1)'s arguments: -u VAR first, then VAR=value).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin="$root/build/nvlua"
n1=${1:-30}; n2=${2:-8}; reps=${3:-3}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
median() { sort -g | awk '{ v[NR] = $1 } END { printf "%.0f", v[int((NR + 1) / 2)] }'; }
step_ms() { # metrics.jsonl -> the ms of each step >= 3, one per line
  awk -F'"ms":' 'NF > 1 { split($2, a, ","); s = $0; sub(/.*"step":/, "", s); sub(/[,}].*/, "", s)
    if (s + 0 >= 3) print a[1] }' "$1"
}
job() { # out steps env... : one run of the main job, no eval, sample or checkpoint
  local out=$1 steps=$2; shift 2
  env "$@" "$bin" "$root/experiments/tiny_llama_nvfp4.lua" steps="$steps" out="$out" quiet=true eval_every=0 \
    sample_tokens=0 ckpt_every=0 >/dev/null
}
IFS=';' read -ra rows <<< "${SETTINGS:-libgomp default (300000 spins)|-u GOMP_SPINCOUNT -u OMP_WAIT_POLICY NVLUA_OMP_DEFAULT=0;nvlua default: GOMP_SPINCOUNT=5000|-u GOMP_SPINCOUNT -u OMP_WAIT_POLICY -u NVLUA_OMP_DEFAULT;GOMP_SPINCOUNT=1000|-u OMP_WAIT_POLICY GOMP_SPINCOUNT=1000;GOMP_SPINCOUNT=10000|-u OMP_WAIT_POLICY GOMP_SPINCOUNT=10000;OMP_WAIT_POLICY=passive|-u GOMP_SPINCOUNT OMP_WAIT_POLICY=passive}"
declare -A alone
for rep in $(seq "$reps"); do
  for i in "${!rows[@]}"; do
    # shellcheck disable=SC2086
    job "$tmp/a$i-$rep" "$n1" ${rows[$i]#*|}
    alone[$i]+="$(step_ms "$tmp/a$i-$rep/metrics.jsonl" | median) "
  done
done
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); $(date -u +%F)"
echo "main job (experiments/tiny_llama_nvfp4.lua): alone $n1 steps x $reps rounds, two at once $n2 steps"
echo
echo "| OpenMP setting | one job, ms/step (rounds) | one job | two at once, ms/step each | two / one |"
echo "|---|---|---:|---:|---:|"
for i in "${!rows[@]}"; do
  envs=${rows[$i]#*|}
  # shellcheck disable=SC2086
  { job "$tmp/p$i-1" "$n2" $envs & job "$tmp/p$i-2" "$n2" $envs; wait; }
  a=$(echo "${alone[$i]}" | tr ' ' '\n' | grep . | median)
  p=$(cat <(step_ms "$tmp/p$i-1/metrics.jsonl") <(step_ms "$tmp/p$i-2/metrics.jsonl") | median)
  echo "| ${rows[$i]%%|*} | ${alone[$i]% } | $a | $p | $(awk "BEGIN { printf \"%.2fx\", $p / $a }") |"
done
