"""Our import names are ours alone: one import root, `lm_console`, shared with no distribution.

transformers 5.25 made Hugging Face's `kernels` distribution a hard dependency and imports it on
a model's first use; a top-level `kernels` package of ours once answered that import. These tests
fail if any top-level name our distribution installs is also another installed distribution's, if
the repository root offers a package or module other than `lm_console` (pytest and `python -m` put
the root on sys.path), or if transformers' hub-kernels integration cannot import beside our
packages.
"""

from __future__ import annotations

import pytest
import importlib.metadata
import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DIST = "lm-console"


def our_top_level_names() -> set[str]:
    mapping = importlib.metadata.packages_distributions()
    return {name for name, dists in mapping.items() if DIST in dists}


def test_our_distribution_installs_one_import_root() -> None:
    assert our_top_level_names() == {"lm_console"}


def test_no_top_level_name_of_ours_belongs_to_another_installed_distribution() -> None:
    mapping = importlib.metadata.packages_distributions()
    shared = {name: sorted(set(mapping[name]) - {DIST}) for name in our_top_level_names()
              if set(mapping[name]) - {DIST}}
    assert not shared, f"top-level names we install that other distributions install too: {shared}"


def test_the_repository_root_offers_no_other_package_or_module() -> None:
    """Folders at the root without __init__.py (tests/, tools/, benchmarks/, ...) hold scripts;
    a package or module there would be importable under its bare name from the root."""
    importable = sorted(p.name for p in ROOT.iterdir()
                        if not p.name.startswith(".") and ((p.is_dir() and (p / "__init__.py").exists())
                                                           or p.suffix == ".py"))
    assert importable == ["lm_console"], importable
    # The old roots are gone entirely: a folder named like a distribution is still found by
    # importlib.util.find_spec (as a namespace package), which is how transformers probes for one.
    assert not (ROOT / "engine").exists() and not (ROOT / "kernels").exists()


HUB_KERNELS_CHECK = """
import importlib.metadata, sys
from pathlib import Path
import lm_console, lm_console.engine, lm_console.kernels, lm_console.kernels.cpu_build
from lm_console.engine.models import embedded  # what a model's first use imports
import transformers.integrations.hub_kernels  # imports Hugging Face's `kernels` where it is installed
import kernels
files = importlib.metadata.distribution("kernels").locate_file("kernels")
assert Path(kernels.__file__).resolve().parent == Path(files).resolve(), (kernels.__file__, files)
print("hub-kernels ok", kernels.__file__)
"""


def test_transformers_hub_kernels_imports_beside_our_packages_from_the_repository_root() -> None:
    importlib.metadata.distribution("kernels")  # transformers >= 5.25 requires it; the lock has it
    done = subprocess.run([sys.executable, "-c", HUB_KERNELS_CHECK], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "hub-kernels ok" in done.stdout, done.stderr[-4000:]


def test_transformers_hub_kernels_imports_inside_the_test_process() -> None:
    """The test process has tests/ and its folders on sys.path (pytest's rootdir import mode)."""
    import kernels
    import transformers.integrations.hub_kernels  # noqa: F401

    assert "site-packages" in Path(kernels.__file__).parts or ROOT not in Path(kernels.__file__).parents
