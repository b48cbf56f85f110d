"""The built distributions: a wheel and an sdist carry the package data and the one version.

Builds from a copy of the packages in a temp dir (no build/ or egg-info left in the checkout),
without build isolation (the venv's setuptools), then runs .ci/check_dist.py, the check that
`make package-check` runs on the distributions it installs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lm_console.engine.version import __version__

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "lm_console")

pytest.importorskip("build", reason="the [test] extra installs `build`")


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(wheel, sdist) built from a copy of the checkout; the wheel is built from the sdist."""
    tmp = tmp_path_factory.mktemp("dist")
    src = tmp / "src"
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(path, src / name)
    result = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "out"), str(src)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = (tmp / "out").glob("*.whl")
    (sdist,) = (tmp / "out").glob("*.tar.gz")
    return wheel, sdist


def test_wheel_and_sdist_carry_the_package_data(dists: tuple[Path, Path]) -> None:
    wheel, sdist = dists
    result = subprocess.run([sys.executable, str(ROOT / ".ci" / "check_dist.py"), str(wheel), str(sdist)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    # Spelled out too, so the check cannot pass on an empty list.
    for name in ("lm_console/kernels/cpu/paged_attention.c", "lm_console/kernels/cpu/cpu_common.h",
                 "lm_console/tui/app.tcss",
                 "lm_console/engine/models/demo_vlm_vision.safetensors",
                 "lm_console/engine/lora/adapters/pirate/adapter_config.json",
                 "lm_console/engine/lora/adapters/pirate/adapter_model.safetensors"):
        assert name in names
    assert not any(name.startswith("tests/") for name in names)


def test_the_wheel_installs_one_import_root(dists: tuple[Path, Path]) -> None:
    """`lm_console` and our dist-info, nothing else at the top of site-packages (no `engine`, no
    `kernels`: Hugging Face's `kernels`, which transformers requires, installs there)."""
    wheel, _ = dists
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        declared = archive.read(top_level).decode().split()
    assert declared == ["lm_console"]
    assert {name.split("/")[0] for name in names} == {"lm_console", top_level.split("/")[0]}


def test_the_distributions_carry_the_one_version(dists: tuple[Path, Path]) -> None:
    wheel, sdist = dists
    assert wheel.name.startswith(f"lm_console-{__version__}-")
    assert sdist.name == f"lm_console-{__version__}.tar.gz"
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
        entry_points = archive.read(metadata.replace("METADATA", "entry_points.txt")).decode()
    assert f"\nVersion: {__version__}\n" in text
    # The base install is the console: no torch unless an extra asks for it.
    requires = [line for line in text.splitlines() if line.startswith("Requires-Dist:")]
    base = [line for line in requires if "extra ==" not in line]
    assert not any("torch" in line or "transformers" in line for line in base), base
    assert any("torch" in line and 'extra == "engine"' in line for line in requires)
    assert "lmc = lm_console.cli:main" in entry_points
