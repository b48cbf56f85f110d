#!/usr/bin/env bash
# `make mutation`: mutation testing (cosmic-ray) of the engine's core modules, each against the
# tests that cover it; writes mutation/<module>.txt (cr-report: every mutant, killed or survived)
# and mutation/summary.txt (killed / survived / incompetent per module). Not in CI: every mutant
# runs its tests once (pytest with torch imported: seconds each), so the whole set takes hours on
# 2 cores. MUTATION_MODULES="name ..." runs some of the modules only (names as in MODULES below);
# MUTATION_SAMPLE=N runs a random sample of N mutants per module instead of all of them, drawn
# with MUTATION_SEED (default 0) so a sample can be rerun; MUTATION_SAMPLE="kv_cache=60 sampler=40"
# sizes the sample per module (a module not named runs all its mutants).
#
# Mutants inside annotations are left out before the sampling (tools/mutation_filter.py: every
# module here has `from __future__ import annotations`, so no annotation is ever evaluated and such
# a mutant is equivalent by construction); each module's summary line says how many.
#
# MUTATION_RESUME=1 (with the same MUTATION_TMP) reuses each module's session instead of drawing
# a new one: the mutants not run yet and the survivors run again, against the tests as they are
# now (how a new test is shown to kill its survivor); killed mutants keep their result.
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

# name: module path | tests run against each of its mutants (pytest -x: the quick files first, so
# most mutants die before the slow property tests run)
kv=tests/core/kv_cache
declare -A MODULES=(
    [kv_cache_hashing]="lm_console/engine/kv_cache_hashing.py|$kv/test_kv_hashing.py $kv/test_kv_manager.py"
    [kv_cache]="lm_console/engine/core/kv_cache|$kv/test_kv_block.py $kv/test_kv_block_pool.py $kv/test_kv_manager.py tests/core/test_request_blocks.py $kv/test_block_metrics.py $kv/test_sliding_window.py $kv/test_kv_properties.py"
    [scheduler]="lm_console/engine/core/sched/scheduler.py|tests/core/sched"
    [sampler]="lm_console/engine/sample|tests/sample/test_sampler.py tests/sample/test_grammar_bitmask.py tests/spec_decode/test_rejection_sampler.py"
    [detokenizer]="lm_console/engine/frontend/detokenizer.py|tests/frontend/test_detokenizer.py"
)
names=${MUTATION_MODULES:-kv_cache_hashing kv_cache scheduler sampler detokenizer}

work=${MUTATION_TMP:-$(mktemp -d)}
mkdir -p "$work/tree" "$ROOT/mutation"
git ls-files -z | (cd "$ROOT" && xargs -0 cp --parents -t "$work/tree")
cd "$work/tree"
export PYTHONPATH=$work/tree${PYTHONPATH:+:$PYTHONPATH}  # the mutated copy before the editable install
for name in $names; do
    [ -n "${MODULES[$name]:-}" ] || { echo "unknown module $name (known: ${!MODULES[*]})" >&2; exit 2; }
done
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
    sample=${MUTATION_SAMPLE:-}
    if [ -n "${MUTATION_RESUME:-}" ] && [ -f "$work/$name.sqlite" ]; then
        "$PY" - "$work/$name.sqlite" <<'PYEOF'
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
n = db.execute("DELETE FROM work_results WHERE test_outcome = 'SURVIVED'").rowcount
db.commit()
print(f"resuming: {n} survivors to run again")
PYEOF
        sample=$(sed -n 's/^sample=//p' "$work/$name.sample" 2>/dev/null || true)
    else
        rm -f "$work/$name.sqlite"
        "$BIN/cosmic-ray" init "$work/$name.toml" "$work/$name.sqlite"
        # Mutants inside annotations (never evaluated under `from __future__ import annotations`)
        # are equivalent by construction: left out before the sampling (tools/mutation_filter.py).
        "$PY" "$ROOT/tools/mutation_filter.py" "$work/$name.sqlite" | tee "$work/$name.filter"
        if [[ $sample == *=* ]]; then
            sample=$(tr ' ' '\n' <<<"$sample" | sed -n "s/^$name=//p")
        fi
        if [ -n "$sample" ]; then
            "$PY" - "$work/$name.sqlite" "$sample" "${MUTATION_SEED:-0}" <<'PYEOF'
import random, sqlite3, sys
db = sqlite3.connect(sys.argv[1])
jobs = db.execute("SELECT job_id FROM mutation_specs ORDER BY module_path, operator_name, start_pos_row, start_pos_col, occurrence").fetchall()
keep = {j for (j,) in random.Random(int(sys.argv[3])).sample(jobs, min(int(sys.argv[2]), len(jobs)))}
drop = [(j,) for (j,) in jobs if j not in keep]
db.executemany("DELETE FROM mutation_specs WHERE job_id = ?", drop)
db.executemany("DELETE FROM work_items WHERE job_id = ?", drop)
db.commit()
print(f"sampled {len(keep)} of {len(jobs)} mutants, random seed {sys.argv[3]}")
PYEOF
        fi
        echo "sample=$sample" >"$work/$name.sample"
    fi
    "$BIN/cosmic-ray" baseline "$work/$name.toml"
    "$BIN/cosmic-ray" exec "$work/$name.toml" "$work/$name.sqlite"
    "$BIN/cr-report" --show-pending --show-diff "$work/$name.sqlite" >"$ROOT/mutation/$name.txt" || true
    echo "$name ($path, ${sample:-all} mutants, seed ${MUTATION_SEED:-0}, $(date -u +%F)):" \
        "$(tail -n 3 "$ROOT/mutation/$name.txt" | tr '\n' ' ')" \
        "($(tail -n 1 "$work/$name.filter" 2>/dev/null || echo "annotation mutants not filtered"))" \
        >"$ROOT/mutation/$name.summary"
done
# summary.txt: the latest run of every module run so far
cat "$ROOT"/mutation/*.summary >"$ROOT/mutation/summary.txt"
cat "$ROOT/mutation/summary.txt"
