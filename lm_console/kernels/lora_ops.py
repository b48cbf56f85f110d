"""Batched LoRA over per-token adapter indices (the punica design: shrink, then expand).

For every token t whose adapter slot s = token_slots[t] is >= 0:

    y[t] += scalings[s] * (x[t] @ A[s]^T) @ B[s]^T

with A [num_slots, R, in] (shrink) and B [num_slots, out, R] (expand); a token with slot -1
runs the base model only. One call serves a batch mixing any adapters and the base.

Three implementations, one contract:
- `add_lora_torch`: the reference, grouped by slot (a gather, two matmuls, a scatter-add each);
- `add_lora_cpu`: a C kernel (lm_console/kernels/cpu/lora.c), float32 accumulation, OpenMP
  over tiles of one adapter's tokens, float32 and bf16 (it serves the CPU whenever the library
  is built). It reads B transposed ([num_slots, R, out]); a B that is a transposed view of such
  a tensor (the model's adapter slots on the CPU) costs no copy;
- `add_lora_triton`: two Triton kernels (shrink into a float32 buffer, expand into y), for
  GPUs; tested under TRITON_INTERPRET=1.
`add_lora` picks one for the tensors' device and dtype.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from lm_console.engine import envs
from lm_console.kernels.cpu_build import load_library

_SOURCE = Path(__file__).parent / "cpu" / "lora.c"


def slot_groups(token_slots: Tensor) -> list[tuple[int, Tensor]]:
    """(slot, the token rows that use it) for each adapter slot present (slot -1 left out).

    The torch path's grouping; the model runner computes it once per step, shared by every layer.
    """
    slots = token_slots.tolist()
    rows: dict[int, list[int]] = {}
    for row, slot in enumerate(slots):
        if slot >= 0:
            rows.setdefault(slot, []).append(row)
    return [(slot, torch.tensor(r, dtype=torch.int64, device=token_slots.device)) for slot, r in sorted(rows.items())]


def check_lora_shapes(where: str, y: Tensor, x: Tensor, a: Tensor, b: Tensor, token_slots: Tensor,
                      scalings: Tensor) -> tuple[int, int, int, int, int]:
    """(num_tokens, in_features, out_features, rank, num_slots) of tensors that fit the
    contract above; ValueError naming `where` and every shape otherwise."""
    num_tokens, out_features = y.shape
    num_slots, rank, in_features = a.shape
    if x.shape != (num_tokens, in_features) or b.shape != (num_slots, out_features, rank) \
            or token_slots.shape != (num_tokens,) or scalings.shape != (num_slots,):
        raise ValueError(f"{where}: shapes y {tuple(y.shape)} x {tuple(x.shape)} a {tuple(a.shape)} "
                         f"b {tuple(b.shape)} slots {tuple(token_slots.shape)} scalings {tuple(scalings.shape)}")
    return num_tokens, in_features, out_features, rank, num_slots


def add_lora_torch(y: Tensor, x: Tensor, a: Tensor, b: Tensor, token_slots: Tensor, scalings: Tensor,
                   groups: list[tuple[int, Tensor]] | None = None) -> Tensor:
    """y [T, out] += the LoRA deltas of x [T, in] (in place; returns y). The reference."""
    if groups is None:
        groups = slot_groups(token_slots)
    for slot, rows in groups:
        xs = x.index_select(0, rows)  # [n, in]
        shrunk = xs @ a[slot].t()  # [n, R]
        delta = (shrunk @ b[slot].t()) * scalings[slot].to(y.dtype)  # [n, out]
        y.index_add_(0, rows, delta)
    return y


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled LoRA kernel, or None (no compiler, LMC_CPU_KERNELS=0, or the build failed)."""
    library = load_library(_SOURCE, "the CPU LoRA kernel")
    if library is not None:
        for name in ("lora_add_f32", "lora_add_bf16"):
            fn = getattr(library, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6
    return library


def cpu_kernel_available() -> bool:
    """Whether the C LoRA kernel is built and loaded on this machine."""
    return load() is not None


def cpu_kernel_serves(y: Tensor, x: Tensor, a: Tensor, b: Tensor, token_slots: Tensor, scalings: Tensor) -> bool:
    """Whether add_lora_cpu takes these tensors (CPU, contiguous (B: either way), one float
    dtype, int64 slots)."""
    dtype = y.dtype
    return (dtype in (torch.float32, torch.bfloat16) and y.device.type == "cpu"
            and all(t.dtype == dtype and t.is_contiguous() for t in (y, x, a)) and b.dtype == dtype
            and (b.is_contiguous() or b.transpose(1, 2).is_contiguous())
            and token_slots.dtype == torch.int64 and token_slots.is_contiguous()
            and scalings.dtype == torch.float32 and scalings.is_contiguous() and load() is not None)


def add_lora_cpu(y: Tensor, x: Tensor, a: Tensor, b: Tensor, token_slots: Tensor, scalings: Tensor) -> Tensor:
    """add_lora_torch's contract in one C call (cpu_kernel_serves must hold); returns y."""
    lib = load()
    assert lib is not None
    num_tokens, in_features, out_features, rank, num_slots = check_lora_shapes(
        "add_lora_cpu", y, x, a, b, token_slots, scalings)
    fn = lib.lora_add_f32 if y.dtype == torch.float32 else lib.lora_add_bf16
    b_t = b.transpose(1, 2)
    if not b_t.is_contiguous():
        b_t = b_t.contiguous()  # one transposed copy (the model's slots keep B transposed already)
    status = fn(y.data_ptr(), x.data_ptr(), a.data_ptr(), b_t.data_ptr(), token_slots.data_ptr(), scalings.data_ptr(),
                num_tokens, in_features, out_features, rank, num_slots, 0)
    if status == 2:
        raise ValueError(f"add_lora_cpu: rank {rank} is outside [1, 4096]")
    if status == 3:
        raise MemoryError(f"add_lora_cpu: no memory for the kernel's scratch ({num_tokens} tokens, in {in_features})")
    if status != 0:
        raise ValueError(f"add_lora_cpu: a token's adapter slot is out of range [-1, {num_slots}) (status {status})")
    return y


def add_lora(y: Tensor, x: Tensor, a: Tensor, b: Tensor, token_slots: Tensor, scalings: Tensor,
             groups: list[tuple[int, Tensor]] | None = None) -> Tensor:
    """y += the LoRA deltas (in place), by the implementation LMC_LORA_KERNEL picks (auto: the
    fastest that serves these tensors; a named one that cannot is refused)."""
    choice = envs.LMC_LORA_KERNEL.get().lower()
    if choice == "torch":
        return add_lora_torch(y, x, a, b, token_slots, scalings, groups)
    if choice == "cpu" or (choice == "auto" and y.device.type == "cpu"):
        if cpu_kernel_serves(y, x, a, b, token_slots, scalings):
            return add_lora_cpu(y, x, a, b, token_slots, scalings)
        if choice == "cpu":
            raise ValueError("LMC_LORA_KERNEL=cpu, but the C LoRA kernel does not serve these tensors "
                             f"({y.dtype} on {y.device}; is a C compiler available?)")
        return add_lora_torch(y, x, a, b, token_slots, scalings, groups)
    if choice == "triton" or (choice == "auto" and y.is_cuda and triton_available()):
        return add_lora_triton(y, x, a, b, token_slots, scalings)
    if choice != "auto":
        raise ValueError(f"LMC_LORA_KERNEL={choice!r} is not one of auto, torch, cpu, triton")
    return add_lora_torch(y, x, a, b, token_slots, scalings, groups)


def triton_available() -> bool:
    """Whether Triton imports (its kernels serve CUDA tensors, or any under TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def add_lora_triton(y: Tensor, x: Tensor, a: Tensor, b: Tensor, token_slots: Tensor, scalings: Tensor) -> Tensor:
    """add_lora_torch's contract as two Triton kernels (shrink, expand); returns y."""
    from lm_console.kernels.lora_triton import lora_shrink_expand

    check_lora_shapes("add_lora_triton", y, x, a, b, token_slots, scalings)
    # The kernels read B [slots, out, R] row-major; the CPU's adapter slots hold it transposed.
    return lora_shrink_expand(y, x, a, b.contiguous(), token_slots, scalings)
