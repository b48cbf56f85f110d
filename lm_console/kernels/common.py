"""What every launcher needs: interpreter detection and small argument checks."""

from __future__ import annotations

import functools

import torch
import triton

from lm_console.engine import envs

# Element types the kernels accept for activations and the KV cache.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` (a decorated @triton.jit function) runs under the CPU interpreter.

    Triton decides this when a kernel is decorated (its module is imported), from the
    environment at that moment; launchers ask their kernel, not the environment of today.
    """
    return type(kernel).__name__ == "InterpretedFunction"


def is_interpreting() -> bool:
    """True when TRITON_INTERPRET is set now: kernels decorated from now on are interpreted."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older versions read the env var
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return envs.TRITON_INTERPRET.get().lower() in ("1", "true", "on")


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (a stand-in of 4 under the interpreter)."""
    if not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def check_float(name: str, tensor: torch.Tensor) -> None:
    """Raise if `tensor` is not fp32/fp16/bf16 or its last axis is not contiguous."""
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: dtype {tensor.dtype} is not one of {FLOAT_DTYPES}")
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name}: the last axis must be contiguous, strides {tensor.stride()}")


def check_same_device(interpreted: bool, **tensors: torch.Tensor) -> None:
    """Raise if the tensors live on different devices, or on CPU for a compiled kernel."""
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        names = {k: str(t.device) for k, t in tensors.items()}
        raise ValueError(f"tensors on several devices: {names}")
    device = devices.pop()
    if device.type == "cpu" and not interpreted:
        raise ValueError(
            "Triton kernels need CUDA tensors; CPU tensors run only under the interpreter "
            "(set TRITON_INTERPRET=1 before the kernel modules are imported)"
        )
    if device.type == "cuda" and interpreted:
        raise ValueError("these kernels were imported under TRITON_INTERPRET=1: CPU tensors only")


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (and >= 1)."""
    return triton.next_power_of_2(max(int(n), 1))
