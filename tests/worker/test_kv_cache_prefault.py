"""kv_cache_prefault: the CPU KV cache's pages are resident after start-up when asked, untouched
(faulted in on first write) otherwise."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest
import torch

from lm_console.engine import LLM
from lm_console.engine.errors import InvalidEngineArgsError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore on Linux only")


def _resident_fraction(tensor: torch.Tensor) -> float:
    """The share of the tensor's pages in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = 4096
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / pages


@pytest.mark.parametrize("prefault", [True, False])
def test_kv_cache_pages_resident_only_when_prefaulted(tiny_llama_dir: Path, prefault: bool) -> None:
    llm = LLM(str(tiny_llama_dir), multiprocess=False, kv_cache_memory=64 << 20, kv_cache_prefault=prefault)
    try:
        runner = llm.engine_core.engine_core.model_executor.worker.model_runner
        fractions = [_resident_fraction(cache) for cache in runner.kv_caches]
        assert all(not cache.any() for cache in runner.kv_caches)  # zeros either way
    finally:
        llm.shutdown()
    if prefault:
        assert min(fractions) == 1.0
    else:
        assert max(fractions) < 0.5  # only what start-up wrote (the profile run writes none)


def test_kv_cache_prefault_must_be_a_bool(tiny_llama_dir: Path) -> None:
    with pytest.raises(InvalidEngineArgsError, match="kv_cache_prefault='yes' is invalid"):
        LLM(str(tiny_llama_dir), multiprocess=False, kv_cache_prefault="yes")
