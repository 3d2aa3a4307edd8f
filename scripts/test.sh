#!/usr/bin/env bash
# scripts/test.sh: set up (scripts/setup.sh), then run the C unit tests and the Lua test suite.
# Extra arguments select Lua test files: scripts/test.sh tensor matmul
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
cd "$root"
c_status=0
if [ $# -eq 0 ]; then build/nvlua_unit || c_status=$?; fi
lua_status=0
build/nvlua tests/run.lua "$@" || lua_status=$?
[ $c_status -eq 0 ] || { echo "C unit tests failed" >&2; exit 1; }
[ $lua_status -eq 0 ] || [ $lua_status -eq 77 ] || exit 1
