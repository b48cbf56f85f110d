"""Check that a built wheel and sdist carry every file the packages read at run time.

Usage: python .ci/check_dist.py WHEEL SDIST (from the checkout's root). Expected: every
non-Python file that git tracks inside the package (lm_console/, engine and kernels included): the C
kernels' sources and headers, the console's stylesheet, and whatever is added there later, so a
file read at run time but missing from pyproject.toml's [tool.setuptools.package-data] fails here.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

PACKAGES = ("lm_console",)


def package_data_files(root: Path) -> list[str]:
    """The non-Python files of the packages at `root` (git-tracked; all files outside a git checkout)."""
    try:
        listed = subprocess.run(["git", "ls-files", *PACKAGES], cwd=root, capture_output=True, text=True,
                                check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        listed = [p.relative_to(root).as_posix() for package in PACKAGES for p in (root / package).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts]
    return sorted(name for name in listed if not name.endswith((".py", ".pyc")))


def wheel_names(wheel: Path) -> set[str]:
    """The paths inside a wheel."""
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def sdist_names(sdist: Path) -> set[str]:
    """The paths inside an sdist, without its top folder (lm_console-0.1.0/)."""
    with tarfile.open(sdist) as archive:
        return {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}


def main(argv: list[str]) -> int:
    wheel, sdist = Path(argv[0]), Path(argv[1])
    expected = package_data_files(Path.cwd())
    if not any(name.endswith(".tcss") for name in expected):
        print(f"no package data found under {Path.cwd()}: run this from the checkout's root", file=sys.stderr)
        return 1
    failed = False
    for name, names in ((wheel.name, wheel_names(wheel)), (sdist.name, sdist_names(sdist))):
        missing = [path for path in expected if path not in names]
        if missing:
            print(f"{name} lacks {missing}", file=sys.stderr)
            failed = True
        else:
            print(f"{name}: all {len(expected)} package-data files ({', '.join(expected)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
