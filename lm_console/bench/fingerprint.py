"""The machine a benchmark ran on, recorded beside its figures, and the CPU time a run used.

A figure without its machine cannot be compared with anything: the same benchmark moves 2-3x
between a Zen 5 and a Sapphire Rapids core, with or without AVX512-BF16, on 2 or 16 usable CPUs.
`fingerprint()` says what matters to our kernels; `fingerprint_id()` hashes the parts that make
two machines comparable (not the commit, not the date), so that a performance baseline can be kept
per machine. `ProcessTreeCpu` measures CPU seconds of this process and its children (the engine
core runs in one): on a shared machine CPU time per token stays put while wall time swings.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from lm_console.engine.platform import affinity_cpus, cgroup_cpu_quota, cpu_flags, usable_cpus

# The ISA features our kernels or torch's choose paths by (platform.py, quant_gemm.c, oneDNN).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8")
# The fields two runs must share to be compared (fingerprint_id hashes them).
COMPARABLE = ("cpu_model", "isa", "usable_cpus", "memory_gib", "torch", "python")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def git_commit(root: Path | None = None) -> str | None:
    """The checkout's commit, with "+dirty" when tracked files changed (None outside a checkout)."""
    root = root or Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the platform has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def fingerprint() -> dict[str, Any]:
    """What a benchmark figure depends on, outside the code: CPU model and ISA flags, the CPUs this
    process may use (affinity, cgroup quota), memory, torch and Python versions, the commit, and
    the load average when it was taken (the machine may be shared)."""
    flags = cpu_flags()
    quota = cgroup_cpu_quota()
    return {
        "cpu_model": _cpu_model(),
        "isa": [flag for flag in ISA_FLAGS if flag in flags],
        "machine_cpus": os.cpu_count(),
        "affinity_cpus": affinity_cpus(),
        "cgroup_cpu_quota": None if quota is None else round(quota, 2),
        "usable_cpus": usable_cpus(),
        "memory_gib": _memory_gib(),
        "torch": _version("torch"),
        "python": platform.python_version(),
        "commit": git_commit(),
        "load_average": load_average(),
    }


def fingerprint_id(print_: dict[str, Any]) -> str:
    """A short hash of the fields that make two machines comparable (COMPARABLE)."""
    fields = {k: print_.get(k) for k in COMPARABLE}
    if isinstance(fields["memory_gib"], (int, float)):
        fields["memory_gib"] = round(fields["memory_gib"])  # 23.5 vs 23.6 GiB: the same machine
    key = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def stamp(result: dict[str, Any]) -> dict[str, Any]:
    """`result` with the date (UTC), the fingerprint and its id added."""
    print_ = fingerprint()
    return {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "fingerprint": print_, "fingerprint_id": fingerprint_id(print_), **result}


def _children_cpu(pid: int) -> float:
    """CPU seconds (user + system) of the live descendants of `pid`, from /proc."""
    total = 0.0
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for child in _descendants(pid):
        try:
            fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone since it was listed
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14, 15)
    return total


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    queue = [pid]
    while queue:
        parent = queue.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.append(child)
                    queue.append(child)
    return found


class ProcessTreeCpu:
    """CPU seconds used by this process and its live children between start() and stop().

    The children's figure comes from /proc (a child that exits in between loses its share, so
    measure while the engine core lives); this process's from time.process_time()."""

    def __init__(self) -> None:
        self._start_own = self._start_children = 0.0
        self.seconds = 0.0
        self.own_seconds = 0.0

    @staticmethod
    def _now() -> tuple[float, float]:
        return time.process_time(), _children_cpu(os.getpid())

    def start(self) -> ProcessTreeCpu:
        own, children = self._now()
        self._start_own, self._start_children = own, children
        return self

    def stop(self) -> float:
        own, children = self._now()
        self.own_seconds = own - self._start_own
        self.seconds = self.own_seconds + (children - self._start_children)
        return self.seconds


def main() -> None:
    """Print this machine's fingerprint and its id as JSON."""
    print_ = fingerprint()
    json.dump({"fingerprint_id": fingerprint_id(print_), "fingerprint": print_}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
