"""Environment variables are declared once (lm_console/engine/envs.py) and read only through it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from lm_console.engine import envs
from lm_console.engine.errors import InvalidEngineArgsError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lm_console"
ENVS = PACKAGE / "engine" / "envs.py"
# Direct os.environ use that is not a read of a setting: values lm-console sets for a library or a
# child process, and Ray's own variables forwarded to a core started elsewhere.
NOT_READS = {
    "lm_console/engine/attention/selector.py",  # sets TRITON_INTERPRET for Triton's interpreter
    "lm_console/engine/malloc_tuning.py",  # sets (and restores) GLIBC_TUNABLES for a child
    "lm_console/engine/executor/ray_utils.py",  # forwards Ray's auth variables; sets CUDA_VISIBLE_DEVICES
}


def _environ_reads(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        text = ast.unparse(node) if isinstance(node, (ast.Call, ast.Subscript)) else ""
        if isinstance(node, ast.Call) and (text.startswith(("os.environ.get(", "os.getenv("))):
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and text.startswith("os.environ[") and isinstance(node.ctx, ast.Load):
            lines.append(node.lineno)
    return lines


def test_the_package_reads_the_environment_only_through_envs() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
                 if path != ENVS and str(path.relative_to(ROOT)) not in NOT_READS
                 for line in _environ_reads(path)]
    assert not offenders, f"environment reads outside lm_console/engine/envs.py: {offenders}"


def test_every_lmc_variable_named_in_the_package_is_declared() -> None:
    declared = {variable.name for variable in envs.VARIABLES}
    named = {name for path in PACKAGE.rglob("*.py") for name in re.findall(r"\bLMC_[A-Z0-9_]+\b", path.read_text())}
    named.discard("LMC_SCALAR")  # a C preprocessor define of the decode-stack driver, not a variable
    assert named <= declared, f"LMC_ variables named but not declared in envs.py: {sorted(named - declared)}"
    assert len(declared) == len(envs.VARIABLES), "a variable is declared twice"
    assert all(variable.help for variable in envs.VARIABLES)


def test_values_are_read_at_use_and_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMC_ENGINE_STARTUP_TIMEOUT", "12.5")
    assert envs.LMC_ENGINE_STARTUP_TIMEOUT.as_float() == 12.5
    monkeypatch.setenv("LMC_ENGINE_STARTUP_TIMEOUT", "soon")
    with pytest.raises(InvalidEngineArgsError, match="LMC_ENGINE_STARTUP_TIMEOUT='soon' must be a number"):
        envs.LMC_ENGINE_STARTUP_TIMEOUT.as_float()
    monkeypatch.delenv("LMC_CPU_KERNELS", raising=False)
    assert not envs.LMC_CPU_KERNELS.is_off()
    monkeypatch.setenv("LMC_CPU_KERNELS", "OFF")
    assert envs.LMC_CPU_KERNELS.is_off()
    monkeypatch.setenv("LMC_QUANT_AUTO", "dense")
    assert envs.LMC_QUANT_AUTO.is_off("none", "dense") and not envs.LMC_QUANT_AUTO.is_off()
