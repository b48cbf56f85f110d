"""lm_console/engine/malloc_tuning.py: freed activations stay in the heap, and child processes put their
heap on transparent huge pages (glibc only)."""

from __future__ import annotations

import multiprocessing
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from lm_console.engine import malloc_tuning

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")

ROOT = Path(__file__).resolve().parent.parent

# A step's pattern: eight 8 MiB activations allocated, written and freed, three times over; the
# third round's minor page faults are what a steady-state step pays.
_STEPS = """
import ctypes, resource, sys
from lm_console.engine import malloc_tuning
tuned = malloc_tuning.tune_malloc() if sys.argv[1] == "tune" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 8 << 20
for round in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(size) for _ in range(8)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks:
        libc.free(block)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(tuned, faults)
"""


def _heap_on_huge_pages() -> bool:
    """Whether this process's environment sets glibc.malloc.hugetlb to 1 or 2 (what glibc read
    at its start, in a child started inside huge_page_heap)."""
    for entry in os.environ.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = entry.partition("=")
        if name == malloc_tuning.HUGETLB_TUNABLE:
            return value in ("1", "2")
    return False


def _third_round_faults(mode: str, **env: str) -> tuple[bool, int]:
    result = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, check=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, timeout=60)
    tuned, faults = result.stdout.split()
    return tuned == "True", int(faults)


def test_tuned_heap_reuses_freed_blocks_without_faulting_them_in_again() -> None:
    untuned, faults = _third_round_faults("plain")
    assert not untuned and faults > 8 * 1024  # glibc trims the freed 64 MiB: every page faults again
    tuned, faults = _third_round_faults("tune")
    assert tuned and faults < 256


def test_lmc_malloc_tuning_0_turns_it_off(monkeypatch) -> None:
    tuned, faults = _third_round_faults("tune", LMC_MALLOC_TUNING="0")
    assert not tuned and faults > 8 * 1024
    monkeypatch.setenv("LMC_MALLOC_TUNING", "0")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    with malloc_tuning.huge_page_heap():
        assert "GLIBC_TUNABLES" not in os.environ


@pytest.mark.parametrize(("given", "expected"), [
    ("", "glibc.malloc.hugetlb=1"),
    ("glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
    ("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=0"),  # the user's choice is kept
    ("glibc.malloc.hugetlb=2:glibc.malloc.arena_max=2", "glibc.malloc.hugetlb=2:glibc.malloc.arena_max=2"),
])
def test_hugetlb_is_added_to_the_tunables_unless_set(given: str, expected: str) -> None:
    assert malloc_tuning.with_hugetlb(given) == expected


@pytest.mark.parametrize("present", [None, "glibc.malloc.arena_max=2"])
def test_the_environment_is_restored_after_the_children_start(monkeypatch, present: str | None) -> None:
    monkeypatch.delenv("LMC_MALLOC_TUNING", raising=False)
    if present is None:
        monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    else:
        monkeypatch.setenv("GLIBC_TUNABLES", present)
    with malloc_tuning.huge_page_heap():
        assert _heap_on_huge_pages()
    assert os.environ.get("GLIBC_TUNABLES") == present


def _report_heap(queue) -> None:
    """In a child: whether its heap is on huge pages, and its AnonHugePages (kB) after a 64 MiB
    block is allocated and written."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    block = libc.malloc(64 << 20)
    ctypes.memset(block, 1, 64 << 20)
    huge = next(int(line.split()[1]) for line in Path("/proc/self/smaps_rollup").read_text().splitlines()
                if line.startswith("AnonHugePages"))
    queue.put((_heap_on_huge_pages(), huge))


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[", 1)[1].split("]", 1)[0]


def test_a_child_started_inside_puts_its_heap_on_huge_pages(monkeypatch) -> None:
    monkeypatch.delenv("LMC_MALLOC_TUNING", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    with malloc_tuning.huge_page_heap():
        child = context.Process(target=_report_heap, args=(queue,))
        child.start()
    on_huge_pages, huge_kb = queue.get(timeout=60)
    child.join(timeout=60)
    assert on_huge_pages
    if _thp_mode() == "never":
        pytest.skip("transparent huge pages are off on this machine")
    assert huge_kb >= 2048  # glibc advised the kernel, and the kernel gave 2 MiB pages
