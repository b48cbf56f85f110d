"""Console test fixtures: a fixed clock, a fake AsyncLLM for the bench/batch commands, a stand-in OpenAI server."""

from __future__ import annotations

import sys
import types
from collections.abc import AsyncIterator
from typing import Any

import pytest


class FixedClock:
    """A clock tests move by hand."""

    def __init__(self, start: float = 1_767_225_600.0) -> None:  # 2026-01-01 00:00:00 UTC
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class StubTokenizer:
    """Enough of a tokenizer for chat templates and lengths."""

    def __len__(self) -> int:
        return 1000

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [100 + (ord(c) % 200) for c in text]


class FakeAsyncLLM:
    """Stands in for engine.frontend.async_llm.AsyncLLM: echoes words, one token a delta."""

    instances: list[FakeAsyncLLM] = []

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine_args = engine_args
        self.closed = False
        FakeAsyncLLM.instances.append(self)

    def get_tokenizer(self) -> StubTokenizer:
        return StubTokenizer()

    async def generate(self, prompt: Any, sampling_params: Any = None,
                       request_id: str | None = None) -> AsyncIterator[Any]:
        import asyncio

        from lm_console.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
        from lm_console.engine.sampling_params import RequestOutputKind

        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
        else:
            text = prompt if isinstance(prompt, str) else prompt["prompt"]
            if "FAIL" in text:
                raise ValueError("prompt asked to fail")
            ids = StubTokenizer().encode(text)
        n = sampling_params.max_tokens or 4
        delta = sampling_params.output_kind == RequestOutputKind.DELTA
        metrics = RequestMetrics(arrival_time=0.0)
        for i in range(n):
            await asyncio.sleep(0)
            last = i == n - 1
            if delta or last:
                tokens = [7] if delta else [7] * n
                text = " w" if delta else " w" * n
                reason = "length" if last else None
                completion = CompletionOutput(index=0, text=text, token_ids=tokens, cumulative_logprob=None,
                                              logprobs=None, finish_reason=reason)
                yield RequestOutput(request_id=request_id or "r", prompt=None, prompt_token_ids=ids,
                                    outputs=[completion], finished=last, metrics=metrics)

    async def abort(self, request_id: str) -> None:
        return None

    def shutdown(self) -> None:
        self.closed = True


@pytest.fixture
def fake_async_llm(monkeypatch: pytest.MonkeyPatch) -> type[FakeAsyncLLM]:
    """Install FakeAsyncLLM as engine.frontend.async_llm.AsyncLLM for one test."""
    module = types.ModuleType("lm_console.engine.frontend.async_llm")
    module.AsyncLLM = FakeAsyncLLM  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lm_console.engine.frontend.async_llm", module)
    FakeAsyncLLM.instances = []
    return FakeAsyncLLM


@pytest.fixture
def clock() -> FixedClock:
    return FixedClock()


@pytest.fixture
def standin():  # noqa: ANN201
    """A stand-in OpenAI server (openai_standin.py) on a free loopback port; `.state` records what it saw."""
    from http_helpers import ServerThread
    from openai_standin import StandinState, standin_app

    state = StandinState()
    with ServerThread(standin_app(state)) as server:
        server.state = state  # type: ignore[attr-defined]
        yield server
