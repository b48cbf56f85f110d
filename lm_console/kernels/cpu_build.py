"""Compile-on-first-use for the CPU C kernels (lm_console/kernels/cpu/*.c), shared by their ctypes loaders.

Each source is compiled with the system C compiler (`cc -O3 -march=native -fopenmp -ffast-math`)
into the user cache, keyed by the source's hash and the machine, so an edited source or another
host gets its own library. The link step has no -ffast-math: with it, GCC links crtfastmath.o,
whose constructor turns on flush-to-zero for the whole process when the library loads (torch's
subnormals would vanish too, and hypothesis refuses to run). The libraries share torch's OpenMP runtime (same `libgomp.so.1`), so
torch.set_num_threads governs them. Where no compiler is found, the build fails, or
LMC_CPU_KERNELS=0, `load_library` returns None and the callers keep their torch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from lm_console.engine import envs
from lm_console.engine.cache_dirs import cache_root

logger = logging.getLogger(__name__)

BUILD_RECIPE = "2: compile with -ffast-math, link without"  # part of the cache key: a new recipe rebuilds


class CpuKernelBuildError(RuntimeError):
    """A C kernel could not be compiled or loaded."""


def kernels_disabled() -> bool:
    """Whether LMC_CPU_KERNELS turns the C kernels off (0 / false / off)."""
    return envs.LMC_CPU_KERNELS.is_off()


def cache_dir() -> Path:
    """Where compiled kernels live: kernels/ under lm-console's cache root."""
    return cache_root() / "kernels"


def build(sources: Path | Sequence[Path], compiler: str, defines: tuple[str, ...] = ()) -> Path:
    """The shared library compiled from `sources` (built once per sources' hash and host).

    Several sources make one library, named after the first.

    `defines` (preprocessor symbols, e.g. a test's scalar-only build) are part of the cache key.
    """
    paths = [sources] if isinstance(sources, Path) else list(sources)
    # The headers beside the sources (#include "..."), so a changed header rebuilds too.
    headers = sorted({header for path in paths for header in path.parent.glob("*.h")})
    source = (b"".join(path.read_bytes() for path in [*paths, *headers])
              + " ".join(defines).encode())
    key = hashlib.sha256(source + platform.machine().encode() + platform.node().encode()
                         + BUILD_RECIPE.encode()).hexdigest()
    target = cache_dir() / f"{paths[0].stem}-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        objects = [Path(tmp) / f"{i}-{path.stem}.o" for i, path in enumerate(paths)]
        commands = [[compiler, "-O3", "-march=native", "-fopenmp", "-fPIC", "-ffast-math",
                     *(f"-D{name}" for name in defines), "-c", str(path), "-o", str(obj)]
                    for path, obj in zip(paths, objects)]
        commands.append([compiler, "-shared", "-fopenmp", *map(str, objects), "-o", str(out), "-lm"])
        for cmd in commands:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                raise CpuKernelBuildError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
        os.replace(out, target)  # atomic: concurrent builders each publish a complete file
    return target


def load_library(sources: Path | Sequence[Path], what: str,
                 defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled library of `sources`, or None (disabled, no compiler, build failed).

    `what` names the kernels in the log line that explains a fallback to torch.
    """
    if kernels_disabled():
        return None
    compiler = envs.CC.get() or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found: %s stay on the torch path", what)
        return None
    try:
        return ctypes.CDLL(str(build(sources, compiler, defines)))
    except (CpuKernelBuildError, OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("%s unavailable, using the torch path: %s", what, exc)
        return None
