"""Host tensors backed by transparent huge pages: the CPU KV cache and the packed weights.

Decode attention reads every running request's KV blocks once per layer, scattered over a
cache of hundreds of MB: with 4 KiB pages nearly every block costs TLB misses (and the
prefetches ahead of it walk page tables too). Asking the kernel for 2 MiB pages on that one
allocation (madvise MADV_HUGEPAGE, honoured where THP is `always` or `madvise`) measured
~13% off the decode attention kernel's time on a 30-layer cache. Elsewhere it is a no-op.
A quantized model's decode step likewise streams every packed weight (~96 MB for SmolLM2) from
DRAM: on 4 KiB pages (the packed-weight cache file mapped privately, as safetensors loads it)
its 120 linears at 29 rows took 16.4-18.2 ms on one core, copied onto huge pages 14.2-14.9 ms
(`HugePageArena`).

The zeros are the kernel's: the tensor is a fresh anonymous private mapping, whose pages read as
zero and are zeroed on first touch, so allocating the cache costs nothing up front and a short
run pays only for the blocks it writes. (Writing zeros over the whole 1 GiB default cache
measured ~3 s of CPU time on a busy 2-core box, most of `lmc generate`'s KV cache phase.)
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import sys
from collections.abc import Iterable

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

_HUGE_PAGE = 1 << 21


def _anonymous_zeros(nbytes: int) -> tuple[Tensor, bool]:
    """A uint8 tensor of nbytes zeros on its own anonymous mapping, 2 MiB-aligned, with huge
    pages advised (before any page is touched); and whether the advice was taken."""
    # One huge page of slack, so the tensor can start on a 2 MiB boundary.
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    offset = (-address) % _HUGE_PAGE
    advised = False
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
            advised = True
        except OSError:
            pass
    # The tensor holds the mapping (a buffer export) for as long as it lives.
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset), advised


def zeros_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                     prefault: bool = False) -> Tensor:
    """torch.zeros(shape), on huge pages and zeroed lazily where the device is the CPU of a Linux host.

    prefault: touch every page now (the kernel zeroes them here, not in the first write); moot
    elsewhere, where torch.zeros has written every page already.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or not sys.platform.startswith("linux") or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    flat, advised = _anonymous_zeros(nbytes)
    if not advised:
        logger.debug("huge pages not available for the KV cache")
    if prefault:
        flat.zero_()  # torch's threads share the page faults
    return flat.view(dtype).view(shape)


def _line_bytes(t: Tensor) -> int:
    """t's bytes rounded up to whole 64-byte lines (its share of an arena)."""
    return -(-t.numel() * t.element_size() // 64) * 64


class HugePageArena:
    """One allocation on huge pages that CPU tensors are copied into one after another, each on
    a 64-byte line; the copies share its mapping, which lives as long as any of them. Pages are
    touched as the copies land, so a caller that drops each original once copied never holds
    both whole sets (a large model's packed weights). Elsewhere than a Linux host, the copies are
    plain contiguous clones."""

    def __init__(self, nbytes: int) -> None:
        self._flat = _anonymous_zeros(nbytes)[0] if sys.platform.startswith("linux") and nbytes > 0 else None
        self._offset = 0

    @classmethod
    def for_tensors(cls, tensors: Iterable[Tensor]) -> HugePageArena:
        """An arena with room for copies of these tensors."""
        return cls(sum(_line_bytes(t) for t in tensors))

    def copy(self, t: Tensor) -> Tensor:
        """A contiguous copy of t (same shape and dtype) in the arena."""
        if self._flat is None or t.device.type != "cpu" or t.numel() == 0:
            return t.contiguous().clone()
        nbytes = t.numel() * t.element_size()
        if self._offset + nbytes > self._flat.numel():
            raise ValueError(f"the arena has {self._flat.numel() - self._offset} bytes left, "
                             f"a copy needs {nbytes}")
        copy = self._flat[self._offset : self._offset + nbytes].view(t.dtype).view(t.shape)
        copy.copy_(t)
        self._offset += _line_bytes(t)
        return copy
