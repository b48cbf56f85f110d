"""LLM with the core in-process loads a plain tokenizer.json on a thread while the weights load,
and loads it again on its own thread when the background load failed (an import race)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import lm_console.engine.frontend.llm as llm_module


def test_tokenizer_loads_on_a_thread_and_again_after_a_failure(tiny_llama_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    real_load = llm_module.load_tokenizer

    def load(tokenizer_dir: Path) -> Any:
        threads.append(threading.current_thread().name)
        if len(threads) == 1:
            raise RuntimeError("deadlock detected by _ModuleLock")  # what CPython raises on an import cycle
        return real_load(tokenizer_dir)

    monkeypatch.setattr(llm_module, "load_tokenizer", load)
    llm = llm_module.LLM(model=str(tiny_llama_dir), multiprocess=False, dtype="float32")
    try:
        assert threads[0].startswith("lmc-tokenizer") and threads[1] == threading.main_thread().name
        assert llm.tokenizer.encode("hello") == real_load(tiny_llama_dir).encode("hello")
    finally:
        llm.shutdown()
