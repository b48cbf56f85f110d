"""The C allocator's settings for the processes that run a model on the CPU.

torch allocates a CPU tensor's memory with the C library's malloc. A prefill step of 2048 tokens
allocates and frees activations of several MiB per layer, and glibc, left to itself, hands every
large freed block back to the kernel (blocks above its mmap threshold, and the heap's free top
above its trim threshold): the next step faults the same memory in again, 4 KiB at a time, each
page zeroed by the kernel. Measured on the embedded model, quantized, 2 cores: 12,000-90,000 minor
faults per 2048-token step, none once tuned, and the batched benchmark's wall time 10-20% shorter
with both settings below (most of it from the second).

- `tune_malloc()`, in the process that runs the model (Worker.init_device): blocks up to 32 MiB
  (glibc's maximum mmap threshold) come from the heap, which is not trimmed below 1 GiB of free
  top, and grows 64 MiB at a time: a step reuses the last step's memory, already mapped and warm
  in the caches.
- `huge_page_heap()`, around the start of the processes we launch (engine cores and, through
  their environment, their workers): GLIBC_TUNABLES gains glibc.malloc.hugetlb=1, so glibc asks
  for transparent huge pages (madvise) on its heap and its mapped blocks: 2 MiB pages, 512 times
  fewer TLB entries for the activations. glibc reads its tunables only when a process starts,
  which is why it is set for children; a user's own glibc.malloc.hugetlb setting is kept.

The process that builds an in-process LLM (multiprocess=False), and Ray actors (Ray starts them),
get the first only. Where the C library is not glibc, nothing changes. LMC_MALLOC_TUNING=0 turns
both off.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
from collections.abc import Iterator

from lm_console.engine import envs

HUGETLB_TUNABLE = "glibc.malloc.hugetlb"

# mallopt parameters (glibc's malloc.h) and our values.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit (HEAP_MAX_SIZE / 2)
_TRIM_THRESHOLD = 1 << 30
_TOP_PAD = 64 << 20


def enabled() -> bool:
    """False when LMC_MALLOC_TUNING=0 (or the C library is not glibc)."""
    return envs.LMC_MALLOC_TUNING.get() != "0" and platform.libc_ver()[0] == "glibc"


@functools.cache
def tune_malloc() -> bool:
    """Keep large freed blocks in this process's heap (module doc); True when applied.

    Once per process: mallopt's settings hold for the process's lifetime.
    """
    if not enabled():
        return False
    libc = ctypes.CDLL(None)  # this process's own symbols: glibc's mallopt among them
    settings = ((_M_MMAP_THRESHOLD, _MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
                (_M_TOP_PAD, _TOP_PAD))
    # mallopt returns 1 on success; a refused value leaves glibc's default in place.
    return all(libc.mallopt(param, value) == 1 for param, value in settings)


def with_hugetlb(tunables: str) -> str:
    """GLIBC_TUNABLES text `tunables` with glibc.malloc.hugetlb=1 added, unless it sets it already."""
    entries = [entry for entry in tunables.split(":") if entry]
    if any(entry.split("=", 1)[0] == HUGETLB_TUNABLE for entry in entries):
        return tunables
    return ":".join([*entries, f"{HUGETLB_TUNABLE}=1"])


@contextlib.contextmanager
def huge_page_heap() -> Iterator[None]:
    """While it is open, processes started from here (spawn, or the forkserver's first start)
    put their malloc heap on transparent huge pages; this process's environment is restored after.
    """
    if not enabled():
        yield
        return
    saved = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"] = with_hugetlb(saved or "")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("GLIBC_TUNABLES", None)
        else:
            os.environ["GLIBC_TUNABLES"] = saved

