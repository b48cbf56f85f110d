"""Where the tests find vLLM's own CPU build: a venv of its own (tools/vllm_env.sh).

LMC_TEST_VLLM_VENV names it (`make test-vllm` sets it). A tests-only variable: the product never
runs vLLM, so it is not one of lm_console/engine/envs.py's settings.
"""

from __future__ import annotations

import os
from pathlib import Path

VLLM_VENV_VARIABLE = "LMC_TEST_VLLM_VENV"


def vllm_venv() -> Path | None:
    """The venv LMC_TEST_VLLM_VENV names when vLLM is installed in it, else None."""
    value = os.environ.get(VLLM_VENV_VARIABLE)
    if not value:
        return None
    venv = Path(value)
    return venv if (venv / "bin" / "python").exists() and any(venv.glob(".installed-*")) else None


def vllm_skip_reason() -> str | None:
    """Why the `vllm` tests cannot run here (None: they can)."""
    if vllm_venv() is not None:
        return None
    value = os.environ.get(VLLM_VENV_VARIABLE)
    if value:
        return f"{VLLM_VENV_VARIABLE}={value} is not an installed vLLM venv (tools/vllm_env.sh {value} installs it)"
    return (f"needs vLLM's CPU build: set {VLLM_VENV_VARIABLE} to a venv made by tools/vllm_env.sh "
            "(`make test-vllm` does both)")
