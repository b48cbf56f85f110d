"""Device and dtype choices: where the model runs and in which precision."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from engine.errors import InvalidEngineArgsError

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# /proc/cpuinfo flags that mean bf16 matrix products run in hardware (oneDNN uses them).
_FAST_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def detect_device() -> torch.device:
    """CUDA when a GPU is visible, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU advertises AMX-BF16 or AVX512-BF16 (bf16 matmuls beat fp32 there)."""
    try:
        return cpuinfo_has_fast_bf16(Path("/proc/cpuinfo").read_text())
    except OSError:
        return False


def cpuinfo_has_fast_bf16(cpuinfo: str) -> bool:
    """Whether the first `flags` line of /proc/cpuinfo text names a fast-bf16 feature."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return any(flag in flags for flag in _FAST_BF16_FLAGS)
    return False


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """Turn a user dtype ("auto", "bf16", torch.float32, ...) into a torch dtype for `device`.

    "auto" picks bf16 on CUDA and on CPUs with fast bf16, float32 otherwise.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in set(_DTYPE_NAMES.values()):
            raise InvalidEngineArgsError(
                f"dtype {dtype} is not supported; use one of float32, bfloat16, float16"
            )
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name == "auto":
        device_type = torch.device(device).type
        if device_type == "cuda" or (device_type == "cpu" and cpu_has_fast_bf16()):
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPE_NAMES:
        allowed = ", ".join(["auto", *_DTYPE_NAMES])
        raise InvalidEngineArgsError(f"unknown dtype {dtype!r}; allowed: {allowed}")
    return _DTYPE_NAMES[name]
