"""Device and dtype choices by name, and the torch objects they stand for.

Configs hold names ("cpu", "bfloat16"): one type in every process, and torch-free. torch is
imported only inside the functions that need it (detect_device, torch_dtype, torch_device),
which run in the engine core and the worker, never in the frontend.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm_console.engine import envs
from lm_console.engine.errors import InvalidEngineArgsError

if TYPE_CHECKING:
    import torch

# Accepted spellings -> the canonical dtype name (a torch attribute name).
_DTYPE_NAMES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}

logger = logging.getLogger(__name__)

CPUINFO = Path("/proc/cpuinfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")

# /proc/cpuinfo flags that mean bf16 matrix products run in hardware (oneDNN uses them).
_FAST_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def detect_device() -> str:
    """"cuda" when a GPU is visible, else "cpu" (asks torch)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def flags_of(cpuinfo: str) -> frozenset[str]:
    """The flags of the first `flags` line of /proc/cpuinfo text (empty when there is none)."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU flags, read once: the one /proc/cpuinfo reader (the dtype default here,
    the quantized kernels' AMX choice); empty where it cannot be read (not Linux)."""
    try:
        return flags_of(CPUINFO.read_text(encoding="ascii", errors="replace"))
    except OSError:
        return frozenset()


def cpu_has_fast_bf16() -> bool:
    """True when the CPU advertises AMX-BF16 or AVX512-BF16 (bf16 matmuls beat fp32 there)."""
    return not _FAST_BF16_FLAGS.isdisjoint(cpu_flags())


# The flags the quantized CPU kernels' vector path is built for (lm_console/kernels/cpu/quant_gemm.c: vpdpbusd).
_INT8_DOT_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_vnni"})


def cpu_has_int8_dot() -> bool:
    """True when the CPU has AVX512-VNNI (with AVX512F/BW): the int8 kernels' vector path. Without
    it they run a portable C path, slower than dense linears, so auto never picks them there."""
    return _INT8_DOT_FLAGS <= cpu_flags()


def cpuinfo_has_fast_bf16(cpuinfo: str) -> bool:
    """Whether the first `flags` line of /proc/cpuinfo text names a fast-bf16 feature."""
    return not _FAST_BF16_FLAGS.isdisjoint(flags_of(cpuinfo))


def resolve_dtype(dtype: Any, device: str) -> str:
    """The canonical dtype name for a user dtype ("auto", "bf16", torch.float32, ...) on `device`.

    "auto" picks bf16 on CUDA and on CPUs with fast bf16, float32 otherwise.
    """
    name = str(dtype).lower().removeprefix("torch.")  # a torch.dtype prints as torch.float32
    if name == "auto":
        if device == "cuda" or (device == "cpu" and cpu_has_fast_bf16()):
            return "bfloat16"
        return "float32"
    if name not in _DTYPE_NAMES:
        allowed = ", ".join(["auto", *_DTYPE_NAMES])
        raise InvalidEngineArgsError(f"unknown dtype {dtype!r}; allowed: {allowed}")
    return _DTYPE_NAMES[name]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical dtype name (ModelConfig.dtype)."""
    import torch

    return getattr(torch, _DTYPE_NAMES[name])


def torch_device(name: str) -> torch.device:
    """The torch device of a device name (DeviceConfig.device)."""
    import torch

    return torch.device(name)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None


def cgroup_cpu_quota(root: Path | None = None, self_cgroup: Path | None = None) -> float | None:
    """The CPU bandwidth this process's cgroup may use, in cores (quota / period), or None when
    unlimited or unknown.

    cgroup v2: the smallest `cpu.max` of this process's cgroup and its ancestors (a parent's limit
    binds its children too); cgroup v1: the cpu controller's cfs_quota_us / cfs_period_us.
    `root` and `self_cgroup` stand for /sys/fs/cgroup and /proc/self/cgroup (tests pass files).
    """
    root = CGROUP_ROOT if root is None else root
    listing = _read(PROC_SELF_CGROUP if self_cgroup is None else self_cgroup) or ""
    quotas: list[float] = []
    for line in listing.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2: walk from our cgroup up to the root
            node = root / path.lstrip("/")
            while True:
                fields = (_read(node / "cpu.max") or "").split()
                if len(fields) == 2 and fields[0] != "max" and int(fields[1]) > 0:
                    quotas.append(int(fields[0]) / int(fields[1]))
                if node == root or root not in node.parents:
                    break
                node = node.parent
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                base = mount / path.lstrip("/")
                quota_text, period_text = _read(base / "cpu.cfs_quota_us"), _read(base / "cpu.cfs_period_us")
                if quota_text and period_text:
                    if int(quota_text) > 0 and int(period_text) > 0:
                        quotas.append(int(quota_text) / int(period_text))
                    break
    return min(quotas) if quotas else None


def affinity_cpus() -> int:
    """How many CPUs this process may run on (its affinity mask; the machine's count where the
    platform has no affinity call)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def usable_cpus(affinity: int | None = None, quota: float | None = None) -> int:
    """The CPUs this process can keep busy: its affinity mask, capped by its cgroup's CPU quota
    (rounded down: a thread over the quota is throttled for the rest of each period, and every
    OpenMP barrier then waits for it). At least 1. os.cpu_count() counts the machine's CPUs,
    which a container or `taskset` may not let us use.

    `affinity` / `quota` stand for affinity_cpus() / cgroup_cpu_quota() (tests pass them)."""
    cpus = affinity_cpus() if affinity is None else affinity
    limit = cgroup_cpu_quota() if quota is None else quota
    if limit is not None:
        cpus = min(cpus, math.floor(limit + 1e-9))
    return max(cpus, 1)


def openmp_loaded() -> bool:
    """Whether this process has loaded an OpenMP runtime (it reads its variables once, at load)."""
    try:
        maps = Path("/proc/self/maps").read_text(errors="replace")
    except OSError:
        return True  # cannot tell: assume too late
    return "libgomp" in maps or "libiomp" in maps or "libomp" in maps


def openmp_wait_environment() -> dict[str, str]:
    """The OpenMP variables the engine sets for its processes: GOMP_SPINCOUNT=LMC_OMP_SPIN, unless
    the user chose a wait policy or a spin count, or LMC_OMP_SPIN is off.

    Why: libgomp's default lets an idle thread spin 300000 times (milliseconds) before it sleeps.
    On a machine whose other processes keep cores busy, a thread waiting at a barrier for a
    descheduled partner spins through its whole time slice, so every parallel region (dozens per
    decode step) costs a scheduler quantum and the CPU is burnt rather than lent: measured on the
    shared 2-core machine, 10x the CPU per token (docs/benchmarks: performance on shared machines).
    A short spin still covers the microseconds between one step's parallel regions."""
    spin = envs.LMC_OMP_SPIN.get().strip()
    if envs.OMP_WAIT_POLICY.is_set() or envs.GOMP_SPINCOUNT.is_set() or spin.lower() in ("off", "false", ""):
        return {}
    if not spin.isdigit():
        raise InvalidEngineArgsError(f"LMC_OMP_SPIN={spin!r} must be a spin count (a whole number) or off")
    return {"GOMP_SPINCOUNT": spin}


def apply_openmp_wait_environment() -> bool:
    """Set openmp_wait_environment() in this process's environment, for itself (when its OpenMP
    runtime is not loaded yet) and for the processes it starts (the engine core's forkserver
    inherits it). Returns whether this process's own runtime will see it."""
    wanted = openmp_wait_environment()
    for name, value in wanted.items():
        os.environ.setdefault(name, value)
    if wanted and openmp_loaded():
        logger.debug("OpenMP is already loaded here (torch imported first): %s applies to child processes only",
                     wanted)
        return False
    return bool(wanted)
