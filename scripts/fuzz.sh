#!/usr/bin/env bash
# scripts/fuzz.sh [cases] [seed] [--ref FILE]: a long run of the test suite's fuzzer (tests/test_fuzz.lua)
# over the safetensors and token-shard readers: `cases` mutated safetensors files (default 100000) and
# half as many shards, from `seed` (default 1), with progress every 5% and a summary. Failing files
# are kept under ${TMPDIR:-/tmp}/nvlua-fuzz-failures (the message names each case;
# NVLUA_FUZZ_SEED=s NVLUA_FUZZ_CASE=i build/nvlua tests/run.lua fuzz reruns one). --ref FILE also
# checks a corpus made by scripts/fuzz_safetensors_ref.py (the reference implementation's
# verdicts) and prints the agreement; without it the committed tests/data/safetensors_ref_corpus.txt
# is checked. Exits non-zero when any case fails.
#   scripts/fuzz.sh 200000 7
#   python scripts/fuzz_safetensors_ref.py --cases 25000 --seed 7 --out /tmp/ref.txt
#   scripts/fuzz.sh 1000 1 --ref /tmp/ref.txt
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cases=100000 seed=1 ref="" positional=0
while [ $# -gt 0 ]; do
  case "$1" in
    --ref) ref=$(cd "$(dirname "$2")" && pwd)/$(basename "$2"); shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *)
      if ! [[ "$1" =~ ^[0-9]+$ ]]; then
        echo "fuzz.sh: '$1' is not a number (usage: scripts/fuzz.sh [cases] [seed] [--ref FILE])" >&2
        exit 2
      fi
      if [ $positional -eq 0 ]; then cases=$1; else seed=$1; fi
      positional=$((positional + 1)); shift ;;
  esac
done
[ -x "$root/build/nvlua" ] || "$root/scripts/setup.sh"
cd "$root"
progress=$(( cases / 20 > 0 ? cases / 20 : 1 ))
echo "fuzz.sh: $cases safetensors cases and $((cases / 2)) shard cases, seed $seed${ref:+, reference corpus $ref}" >&2
start=$(date +%s)
status=0
keep=${TMPDIR:-/tmp}/nvlua-fuzz-failures
env NVLUA_FUZZ_CASES="$cases" NVLUA_FUZZ_SEED="$seed" NVLUA_FUZZ_PROGRESS="$progress" NVLUA_FUZZ_KEEP="$keep" \
  ${ref:+NVLUA_FUZZ_REF="$ref"} build/nvlua tests/run.lua fuzz || status=$?
verdict="no failures"
[ $status -eq 0 ] || verdict="FAILURES (see above; the failing files are in $keep)"
echo "fuzz.sh: $(( $(date +%s) - start )) s, $verdict" >&2
exit $status
