"""Grammar compiles are bounded: a deadline per compile, cancellation when the request ends, no
compile waiting behind a stuck one, and a bounded compiled-grammar cache."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from lm_console.engine.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = [pytest.mark.slow, pytest.mark.hostile]


class FakeBackend:
    """Compiles "slow" regexes only when released; anything else at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.compiled: list[str] = []

    def compile(self, kind: str, spec: str, stop_token_ids: Any) -> Any:
        if spec.startswith("slow"):
            self.release.wait(30)
        self.compiled.append(spec)
        return SimpleNamespace(spec=spec)


def make_manager(monkeypatch, timeout_s: float) -> tuple[Any, FakeBackend]:
    from lm_console.engine.config.structured_outputs import StructuredOutputsConfig
    from lm_console.engine.structured_output import StructuredOutputManager

    config = SimpleNamespace(model_config=SimpleNamespace(tokenizer_dir="unused", vocab_size=32),
                             structured_outputs_config=StructuredOutputsConfig(compile_timeout_s=timeout_s))
    manager = StructuredOutputManager(config)
    backend = FakeBackend()
    monkeypatch.setattr(manager, "_get_backend", lambda: backend)
    return manager, backend


def structured_request(regex: str) -> Any:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=regex))
    return SimpleNamespace(sampling_params=params, eos_token_id=2, structured_output_request=None, status=None)


def wait_ready(request: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not request.structured_output_request.is_grammar_ready():
        assert time.monotonic() < deadline, "the compile neither finished nor timed out"
        time.sleep(0.02)


def test_a_compile_past_its_deadline_fails_and_others_do_not_wait_for_it(monkeypatch) -> None:
    manager, backend = make_manager(monkeypatch, timeout_s=0.3)
    try:
        slow = [structured_request(f"slow{i}") for i in range(manager._num_slots)]  # every slot taken
        for request in slow:
            manager.grammar_init(request)
        fast = structured_request("fast")
        manager.grammar_init(fast)
        for request in slow:
            wait_ready(request)
            error = request.structured_output_request.error
            assert error is not None and "did not compile within 0.3 s" in error[1], error
        wait_ready(fast)  # its compile got a slot although the slow ones still run
        assert fast.structured_output_request.grammar is not None
        assert manager.num_abandoned == len(slow)
    finally:
        backend.release.set()
    deadline = time.monotonic() + 10
    while manager.num_abandoned and time.monotonic() < deadline:
        time.sleep(0.02)
    assert manager.num_abandoned == 0  # finished unobserved, and counted out


def test_a_constraint_that_compiled_before_does_not_wait_for_a_slot(monkeypatch) -> None:
    manager, backend = make_manager(monkeypatch, timeout_s=60)
    try:
        first = structured_request("known")
        manager.grammar_init(first)
        wait_ready(first)
        for i in range(manager._num_slots):  # every slot taken by a slow stranger
            manager.grammar_init(structured_request(f"slow{i}"))
        again = structured_request("known")
        manager.grammar_init(again)
        wait_ready(again, timeout_s=5)
        assert again.structured_output_request.grammar is not None
    finally:
        backend.release.set()


def test_ending_a_request_cancels_its_compile(monkeypatch) -> None:
    manager, backend = make_manager(monkeypatch, timeout_s=60)
    try:
        running = [structured_request(f"slow{i}") for i in range(manager._num_slots)]
        for request in running:
            manager.grammar_init(request)
            manager.add_request(request)
        queued = structured_request("slow-queued")
        manager.grammar_init(queued)
        manager.add_request(queued)
        time.sleep(0.1)
        manager.finish_request(queued)  # aborted while waiting for a slot: never compiled
        assert queued.structured_output_request.future.cancelled()
        for request in running:  # aborted mid-compile: the slot comes back at once
            manager.finish_request(request)
        after = structured_request("fast")
        manager.grammar_init(after)
        wait_ready(after, timeout_s=5)
        assert after.structured_output_request.grammar is not None
    finally:
        backend.release.set()
    time.sleep(0.2)
    assert "slow-queued" not in backend.compiled


def test_compiled_grammar_cache_is_bounded(tiny_llama_dir) -> None:
    import json

    from lm_console.engine.config.structured_outputs import StructuredOutputsConfig
    from lm_console.engine.structured_output.backend_xgrammar import XgrammarBackend

    vocab_size = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    default = XgrammarBackend(str(tiny_llama_dir), vocab_size)
    assert default.compiler.cache_limit_bytes == StructuredOutputsConfig().cache_bytes > 0
    limit = 256 << 10
    backend = XgrammarBackend(str(tiny_llama_dir), vocab_size, cache_bytes=limit)
    for i in range(60):  # distinct schemas (~85 KB compiled each here; 5 MB unbounded), as clients send them
        schema = {"type": "object", "properties": {f"field_{i}_{j}": {"type": "integer"} for j in range(8)},
                  "required": [f"field_{i}_0"]}
        backend.compile("json", json.dumps(schema), None)
        # xgrammar evicts after it inserts: the cache may pass the limit by the newest grammar at most.
        assert backend.compiler.get_cache_size_bytes() <= 2 * limit
