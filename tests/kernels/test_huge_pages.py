"""zeros_huge_pages: a zero tensor of the asked shape and dtype, whose pages are touched lazily."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from lm_console.kernels.huge_pages import HugePageArena, zeros_huge_pages

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_zeros_of_the_shape_and_dtype(dtype: torch.dtype) -> None:
    shape = (2, 37, 16, 3, 64)
    cache = zeros_huge_pages(shape, dtype, CPU)
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert cache.device == CPU and not cache.any()
    cache[1, 5, 3] = 2.5  # writable, and the rest stays zero
    gc.collect()  # the tensor alone keeps its memory alive
    assert cache.sum().item() == 2.5 * 3 * 64
    assert zeros_huge_pages((0, 4), dtype, CPU).shape == (0, 4)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="anonymous mappings on Linux only")
def test_large_cache_is_not_touched_up_front() -> None:
    """A 256 MiB cache raises the resident set by far less than its size until it is written."""
    def rss_bytes() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = rss_bytes()
    cache = zeros_huge_pages((256, 1 << 20), torch.uint8, CPU)
    assert cache.data_ptr() % (1 << 21) == 0  # starts on a huge page
    assert rss_bytes() - before < 64 << 20
    cache[:2].fill_(1)
    assert cache[:2].all() and not cache[2:3].any()


def test_arena_copies_keep_values_shapes_and_dtypes() -> None:
    tensors = [torch.randint(0, 255, (33, 7), dtype=torch.uint8), torch.randn(5, 3).half(),
               torch.randn(11), torch.empty(0, 4), torch.randn(4, 6).t()]  # the last not contiguous
    arena = HugePageArena.for_tensors(tensors)
    copies = [arena.copy(t) for t in tensors]
    for t, c in zip(tensors, copies):
        assert c.shape == t.shape and c.dtype == t.dtype and c.is_contiguous() and torch.equal(c, t)
        assert c.data_ptr() != t.data_ptr() or t.numel() == 0
    if sys.platform.startswith("linux"):
        pointers = [c.data_ptr() for c in copies if c.numel()]
        assert pointers[0] % (1 << 21) == 0 and all(p % 64 == 0 for p in pointers)
    expected = [t.clone() for t in tensors]
    del tensors
    gc.collect()  # the copies alone keep the arena alive
    assert all(torch.equal(c, e) for c, e in zip(copies, expected))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the arena is a mapping on Linux only")
def test_an_arena_holds_what_it_was_sized_for_and_refuses_more() -> None:
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int16)]
    arena = HugePageArena.for_tensors(tensors)
    copies = [arena.copy(t) for t in tensors]
    assert all(torch.equal(c, t) for c, t in zip(copies, tensors))
    with pytest.raises(ValueError, match="bytes left"):
        arena.copy(torch.randn(64))
