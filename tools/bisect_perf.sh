#!/usr/bin/env bash
# CPU time per output token of W32 at COMMIT (benchmarks/bisect_probe.py), for bisecting a slowdown:
#   tools/bisect_perf.sh COMMIT [THREADS=1] [VARIANT=none]     (PROBE_MP=1: engine core in its own process)
# The commit's files are exported (git archive, no worktree) under BISECT_DIR (default
# /tmp/lmc-bisect) and run with this checkout's venv; KEEP=1 keeps the export.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
commit=$(git -C "$root" rev-parse --short "$1")
dir=${BISECT_DIR:-/tmp/lmc-bisect}/$commit
mkdir -p "$dir"
[[ -f "$dir/.exported" ]] || { git -C "$root" archive "$commit" | tar -x -C "$dir"; touch "$dir/.exported"; }
cd /tmp
PYTHONPATH="$dir" OMP_WAIT_POLICY=PASSIVE "$root/.venv/bin/python" "$root/benchmarks/bisect_probe.py" "$dir" \
    "${2:-1}" "${3:-none}" 2>&1 | grep -E "^RESULT|Error" | tail -3
[[ "${KEEP:-0}" == 1 ]] || rm -rf "$dir"
