"""The CPU's feature flags (Linux /proc/cpuinfo): the one reader the kernels and the engine ask.

Torch-free and import-light: engine/platform.py picks the default dtype with it at start-up.
"""

from __future__ import annotations

import functools
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def flags_of(cpuinfo: str) -> frozenset[str]:
    """The flags of the first `flags` line of /proc/cpuinfo text (empty when there is none)."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU flags (empty where /proc/cpuinfo cannot be read, e.g. not Linux)."""
    try:
        return flags_of(CPUINFO.read_text(encoding="ascii", errors="replace"))
    except OSError:
        return frozenset()
