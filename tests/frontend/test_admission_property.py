"""Property (issue 18 acceptance): whatever a caller passes, every call ends, the engine keeps serving.

Hypothesis throws arbitrary values and types at LLM.generate, AsyncLLM.generate and `lmc batch`
lines: wrong types, bools, NaN, inf, huge ints, lone surrogates, SamplingParams changed after
construction, odd request ids. Each call must end in a result or an engine.errors exception
within DEADLINE_S (a hang guard: on main such a call waited forever), the engine must still
serve a normal request, and no KV block may leak. One engine of each kind serves every example.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lm_console.engine import AsyncLLM, LLM, SamplingParams
from lm_console.engine.errors import EngineError
from lm_console.engine.outputs import RequestOutput
from llm_helpers import assert_no_leaked_blocks

DEADLINE_S = 5.0  # the acceptance bound; the tiny model answers any accepted request far sooner
# max_model_len 32: whatever max_tokens and n a caller picks, a request ends within 31 tokens.
ENGINE_ARGS = dict(dtype="float32", max_model_len=32, num_gpu_blocks_override=512, max_num_seqs=64)
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
TEXT = st.text(st.one_of(st.characters(), SURROGATES), max_size=12)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, -math.inf, 0.5, 1e308]),
    TEXT, st.binary(max_size=8),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(TEXT, st.integers(), st.booleans()), inner, max_size=3)),
    max_leaves=8)
FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
TOKEN_IDS = st.lists(st.one_of(st.integers(min_value=0, max_value=200), VALUES), min_size=0, max_size=8)
PROMPTS = st.one_of(
    TEXT, VALUES, st.just("a fine prompt"),
    st.fixed_dictionaries({"prompt_token_ids": TOKEN_IDS}),
    st.fixed_dictionaries({"prompt": st.one_of(TEXT, VALUES)}),
    st.dictionaries(st.one_of(st.sampled_from(["prompt", "prompt_token_ids", "cache_salt", "multi_modal_data",
                                               "mm_processor_kwargs", "extra"]), TEXT), VALUES, max_size=3),
)
REQUEST_IDS = st.one_of(st.none(), TEXT, VALUES)


@st.composite
def sampling_params(draw: Any) -> Any:
    """A SamplingParams with arbitrary fields (set after construction, past its checks), or not one at all."""
    kind = draw(st.sampled_from(["mutated", "mutated", "plain", "other"]))
    if kind == "other":
        return draw(VALUES)
    params = SamplingParams(max_tokens=draw(st.integers(1, 6)), temperature=draw(st.sampled_from([0.0, 0.8])))
    if kind == "mutated":
        for name in draw(st.lists(st.sampled_from(FIELDS), max_size=3)):
            setattr(params, name, draw(VALUES))
    return params


def _check(result: Any) -> None:
    if isinstance(result, BaseException):
        assert isinstance(result, EngineError), f"{type(result).__name__}: {result}"
    else:
        assert all(isinstance(o, RequestOutput) and o.finished for o in result)


def _in_thread(call: Any) -> Any:
    """call() in a worker thread; its result or exception, or a failure after DEADLINE_S."""
    box: list[Any] = []

    def target() -> None:
        try:
            box.append(call())
        except BaseException as error:  # noqa: BLE001 - judged by the caller
            box.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), "the call did not end: a request went unanswered"
    return box[0]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir), **ENGINE_ARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def async_llm(tiny_llama_dir):
    engine = AsyncLLM(str(tiny_llama_dir), stat_loggers=[], **ENGINE_ARGS)
    yield engine
    engine.shutdown()


@SETTINGS
@given(prompts=st.lists(PROMPTS, min_size=1, max_size=3), params=sampling_params(), single=st.booleans())
def test_llm_generate_always_answers(llm, prompts, params, single) -> None:
    result = _in_thread(lambda: llm.generate(prompts[0] if single else prompts, params, use_tqdm=False))
    _check(result)
    ok = _in_thread(lambda: llm.generate("still serving", SamplingParams(max_tokens=2), use_tqdm=False))
    _check(ok)
    assert not isinstance(ok, BaseException)
    assert_no_leaked_blocks(llm)


@SETTINGS
@given(prompt=PROMPTS, params=sampling_params(), request_id=REQUEST_IDS)
def test_async_generate_always_answers(async_llm, prompt, params, request_id) -> None:
    async def one() -> list[RequestOutput]:
        return [o async for o in async_llm.generate(prompt, params, request_id)]

    async def main() -> None:
        try:
            result: Any = await asyncio.wait_for(one(), DEADLINE_S)
        except asyncio.TimeoutError:
            pytest.fail("AsyncLLM.generate did not end: a request went unanswered")
        except BaseException as error:  # noqa: BLE001 - judged below
            result = error
        _check([result[-1]] if isinstance(result, list) and result else result)
        fine = await asyncio.wait_for(one_fine(), DEADLINE_S)
        assert fine.finished
        assert_no_leaked_blocks(await async_llm.get_block_pool_state())

    async def one_fine() -> RequestOutput:
        return [o async for o in async_llm.generate("still serving", SamplingParams(max_tokens=2))][-1]

    asyncio.run(main())


BODY = st.dictionaries(st.sampled_from(["prompt", "messages", "max_tokens", "temperature", "top_p", "n", "seed",
                                        "stop", "ignore_eos", "min_tokens", "top_k"]),
                       st.one_of(VALUES, PROMPTS), max_size=5)
LINES = st.one_of(
    st.builds(lambda cid, url, body: json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body},
                                                default=lambda o: o.decode("latin-1")),  # bytes -> str
              st.one_of(TEXT, VALUES), st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/x"]),
              st.one_of(BODY, st.fixed_dictionaries({"prompt": TEXT, "max_tokens": st.integers(-2, 10**20)}))),
    st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
    TEXT,
)


def _json_safe(line: str) -> str:
    try:
        line.encode("utf-8")
        return line
    except UnicodeEncodeError:  # json.dumps escaped them; a raw surrogate cannot be in a file
        return line.encode("utf-8", "backslashreplace").decode("utf-8")


@SETTINGS
@given(lines=st.lists(LINES, min_size=1, max_size=4))
def test_batch_lines_always_get_a_record(async_llm, lines) -> None:
    from lm_console.batch import stream_batch

    lines = [_json_safe(line).replace("\n", " ") for line in lines]
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    records: list[dict] = []

    async def source():
        for item in numbered:
            yield item

    async def main() -> None:
        try:
            await asyncio.wait_for(stream_batch(async_llm, source(), records.append, "m", progress=False),
                                   DEADLINE_S * max(len(numbered), 1))
        except asyncio.TimeoutError:
            pytest.fail("lmc batch did not finish: a line went unanswered")
        assert_no_leaked_blocks(await async_llm.get_block_pool_state())

    asyncio.run(main())
    assert len(records) == len(numbered)
    assert all(r["response"]["status_code"] in (200, 400) for r in records), records
