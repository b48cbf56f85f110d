#!/usr/bin/env bash
# `make mutation`: mutation testing (cosmic-ray) of the engine's core modules, each against the
# tests that cover it; writes mutation/<module>.txt (cr-report: every mutant, killed or survived)
# and mutation/summary.txt (killed / survived / incompetent per module). Not in CI: every mutant
# runs its tests once (pytest with torch imported: seconds each), so the whole set takes hours on
# 2 cores. MUTATION_MODULES="name ..." runs some of the modules only (names as in MODULES below);
# MUTATION_SAMPLE=N runs a seeded random sample of N mutants per module instead of all of them.
#
# The mutants are applied in a copy of the tracked tree (under $MUTATION_TMP, default a temp dir)
# put first on PYTHONPATH, so the working tree is never modified.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
CR_VERSION=8.7.0
"$PY" -m pip show cosmic-ray >/dev/null 2>&1 || "$PY" -m pip install -q "cosmic-ray==$CR_VERSION"
BIN=$(dirname "$PY")

# name: module path | tests run against each of its mutants
declare -A MODULES=(
    [kv_cache_hashing]="lm_console/engine/kv_cache_hashing.py|tests/core/kv_cache/test_kv_hashing.py tests/core/kv_cache/test_kv_manager.py"
    [kv_cache]="lm_console/engine/core/kv_cache|tests/core/kv_cache tests/core/test_request_blocks.py"
    [scheduler]="lm_console/engine/core/sched/scheduler.py|tests/core/sched"
    [sampler]="lm_console/engine/sample/sampler.py|tests/sample"
    [detokenizer]="lm_console/engine/frontend/detokenizer.py|tests/frontend/test_detokenizer.py"
)
names=${MUTATION_MODULES:-kv_cache_hashing kv_cache scheduler sampler detokenizer}

work=${MUTATION_TMP:-$(mktemp -d)}
mkdir -p "$work/tree" "$ROOT/mutation"
git ls-files -z | (cd "$ROOT" && xargs -0 cp --parents -t "$work/tree")
cd "$work/tree"
export PYTHONPATH=$work/tree${PYTHONPATH:+:$PYTHONPATH}  # the mutated copy before the editable install
summary=$ROOT/mutation/summary.txt
: >"$summary"
for name in $names; do
    IFS='|' read -r path tests <<<"${MODULES[$name]}"
    cat >"$work/$name.toml" <<EOF
[cosmic-ray]
module-path = "$path"
timeout = 120.0
excluded-modules = []
test-command = "$PY -m pytest -x -q -p no:randomly -p no:cacheprovider $tests"

[cosmic-ray.distributor]
name = "local"
EOF
    rm -f "$work/$name.sqlite"
    "$BIN/cosmic-ray" init "$work/$name.toml" "$work/$name.sqlite"
    if [ -n "${MUTATION_SAMPLE:-}" ]; then
        "$PY" - "$work/$name.sqlite" "$MUTATION_SAMPLE" <<'PYEOF'
import random, sqlite3, sys
db = sqlite3.connect(sys.argv[1])
jobs = db.execute("SELECT job_id FROM mutation_specs ORDER BY operator_name, start_pos_row, start_pos_col, occurrence").fetchall()
keep = {j for (j,) in random.Random(0).sample(jobs, min(int(sys.argv[2]), len(jobs)))}
drop = [(j,) for (j,) in jobs if j not in keep]
db.executemany("DELETE FROM mutation_specs WHERE job_id = ?", drop)
db.executemany("DELETE FROM work_items WHERE job_id = ?", drop)
db.commit()
print(f"sampled {len(keep)} of {len(jobs)} mutants")
PYEOF
    fi
    "$BIN/cosmic-ray" baseline "$work/$name.toml"
    "$BIN/cosmic-ray" exec "$work/$name.toml" "$work/$name.sqlite"
    "$BIN/cr-report" --show-pending "$work/$name.sqlite" >"$ROOT/mutation/$name.txt" || true
    echo "$name ($path): $(tail -n 3 "$ROOT/mutation/$name.txt" | tr '\n' ' ')" >>"$summary"
done
cat "$summary"
