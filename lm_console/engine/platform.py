"""Device and dtype choices by name, and the torch objects they stand for.

Configs hold names ("cpu", "bfloat16"): one type in every process, and torch-free. torch is
imported only inside the functions that need it (detect_device, torch_dtype, torch_device),
which run in the engine core and the worker, never in the frontend.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

CPUINFO = Path("/proc/cpuinfo")

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
