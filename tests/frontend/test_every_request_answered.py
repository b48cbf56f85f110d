"""Every request gets an answer (issue 18): admission, the core's own checks, n > 1 ids, late answers.

Each test here hung, crashed the core or leaked state on main 7da66f0 (see the issue's items).
Every await has a hang guard (asyncio.wait_for / pytest-timeout): a regression fails, never hangs.
"""

from __future__ import annotations

import asyncio
import time
import concurrent.futures

import msgspec
import pytest

from lm_console.engine import AsyncLLM, LLM, RequestOutputKind, SamplingParams
from lm_console.engine.errors import (
    DuplicateRequestError, InvalidPromptError, InvalidRequestError, InvalidRequestIdError,
    InvalidSamplingParamsError, RequestRejectedError,
)
from lm_console.engine.frontend.mp_client import _AsyncSink
from lm_console.engine.metrics.kv_events import AllBlocksCleared, KVEventBatch
from lm_console.engine.protocol import EngineCoreOutputs, EngineCoreRequestType, UtilityOutput
from llm_helpers import assert_no_leaked_blocks

ENGINE_ARGS = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=128)
pytestmark = pytest.mark.timeout(240)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


@pytest.fixture(scope="module")
def async_llm(tiny_llama_dir):
    engine = AsyncLLM(str(tiny_llama_dir), stat_loggers=[], **ENGINE_ARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir), **ENGINE_ARGS)
    yield engine
    engine.shutdown()


def _mutated(field: str, value) -> SamplingParams:
    params = SamplingParams(max_tokens=4)
    setattr(params, field, value)
    return params


# (prompt, params or a factory, request_id, expected error): item 1's triggers and their kin.
TRIGGERS = [
    ("hi", lambda: _mutated("temperature", True), None, InvalidSamplingParamsError),
    ("hi", lambda: _mutated("ignore_eos", "yes"), None, InvalidSamplingParamsError),
    ("hi", lambda: _mutated("extra_args", {1: 2}), None, InvalidSamplingParamsError),
    ("hi", lambda: _mutated("temperature", -1.0), None, InvalidSamplingParamsError),
    ("hi", lambda: _mutated("seed", 10**30), None, InvalidSamplingParamsError),
    ("hi", lambda: _mutated("logprobs", 10**6), None, InvalidSamplingParamsError),
    ({"prompt_token_ids": [True, 5]}, lambda: SamplingParams(max_tokens=4), None, InvalidPromptError),
    ({"prompt_token_ids": [49152]}, lambda: SamplingParams(max_tokens=4), None, InvalidPromptError),
    ({"prompt_token_ids": 5}, lambda: SamplingParams(max_tokens=4), None, InvalidPromptError),
    ("a\udc80b", lambda: SamplingParams(max_tokens=4), None, InvalidPromptError),
    ({"prompt": "hi", "bogus": 1}, lambda: SamplingParams(max_tokens=4), None, InvalidPromptError),
    ("hi", lambda: SamplingParams(max_tokens=4), 123, InvalidRequestIdError),
    ("hi", lambda: {"temperature": 0}, None, InvalidSamplingParamsError),
]


def test_async_generate_answers_every_trigger_with_its_error(async_llm) -> None:
    async def main():
        for prompt, params, request_id, expected in TRIGGERS:
            with pytest.raises(expected):
                async for _ in async_llm.generate(prompt, params(), request_id):
                    pass
        outputs = [o async for o in async_llm.generate("still serving", SamplingParams(max_tokens=5, ignore_eos=True))]
        assert len(outputs[-1].outputs[0].token_ids) == 5
        assert_no_leaked_blocks(await async_llm.get_block_pool_state())
        assert not async_llm.output_processor.request_states and not async_llm.output_processor.parent_requests

    run(main())


def test_llm_generate_refuses_a_batch_with_one_bad_request_before_running_any(llm) -> None:
    good = SamplingParams(max_tokens=4, ignore_eos=True)
    for prompt, params, _, expected in TRIGGERS:
        if expected is InvalidRequestIdError:
            continue  # LLM makes its own ids
        with pytest.raises(expected):
            llm.generate(["fine", prompt, "fine too"], [good, params(), good], use_tqdm=False)
        assert not llm.output_processor.request_states
    with pytest.raises(InvalidPromptError):
        llm.generate(12, use_tqdm=False)
    with pytest.raises(InvalidSamplingParamsError):
        llm.generate(["a", "b"], "not params", use_tqdm=False)
    assert len(llm.generate("fine", good, use_tqdm=False)[0].outputs[0].token_ids) == 4
    assert_no_leaked_blocks(llm)


def _raw_request(llm: LLM, request_id: str, prompt: str = "hello there") -> list:
    """A valid request as the generic msgpack array the core receives (to be spoiled)."""
    _, request = llm.input_processor.process_inputs(request_id, prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    items = msgspec.msgpack.decode(msgspec.msgpack.encode(request))
    return items + [None, 0, None][len(items) - 5:]  # the trailing defaults msgspec omits


def _send_add(llm: LLM, items: list) -> None:
    resources = llm.engine_core.resources
    with resources.send_lock:
        resources.input_socket.send_multipart(
            [resources.core_identity, EngineCoreRequestType.ADD.frame(), msgspec.msgpack.encode(items)])


def test_the_core_answers_each_bad_request_alone_and_keeps_serving(llm) -> None:
    """Items 1 (defence in depth) and 12: a message the frontend would never send."""
    vocab = llm.config.model_config.vocab_size
    good = _raw_request(llm, "good")
    big_token = _raw_request(llm, "big-token")
    big_token[1] = [1, vocab + 5]  # killed the core on main
    bool_token = _raw_request(llm, "bool-token")
    bool_token[1] = [True, 5]  # dropped the whole message on main
    bad_client = _raw_request(llm, "bad-client")
    bad_client[6] = 7  # killed the core on main
    bad_params = _raw_request(llm, "bad-params")
    bad_params[2]["temperature"] = -3.0
    too_many_logprobs = _raw_request(llm, "many-logprobs")
    too_many_logprobs[2]["logprobs"] = 10**6
    _send_add(llm, [good, big_token, bool_token, bad_client, bad_params, too_many_logprobs, [5, "no id"]])
    finished = {}
    while len(finished) < 6:
        for output in llm.engine_core.get_output().outputs:
            if output.finished:
                finished[output.request_id] = output
    assert finished["good"].error is None and len(finished["good"].new_token_ids) == 1
    expected = {"big-token": "InvalidPromptError", "bool-token": "InvalidPromptError",
                "bad-client": "RequestRejectedError", "bad-params": "InvalidSamplingParamsError",
                "many-logprobs": "InvalidSamplingParamsError"}
    assert {k: v.error.exc_type for k, v in finished.items() if k != "good"} == expected
    assert llm.engine_core.proc.is_alive()
    assert len(llm.generate("after", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
               .outputs[0].token_ids) == 3
    assert_no_leaked_blocks(llm)


def test_a_core_refusal_reaches_the_caller_as_its_error(async_llm) -> None:
    """The frontend turns the core's error output into the request's exception."""
    async def main():
        collector = await async_llm.add_request("refused", "hello", SamplingParams(max_tokens=4))
        # What the core answers for a request it refuses (as in the test above).
        from lm_console.engine.protocol import EngineCoreOutput, FinishReason, RequestError

        outputs = EngineCoreOutputs(outputs=[EngineCoreOutput(
            "refused", [], finish_reason=FinishReason.ABORT, error=RequestError("InvalidPromptError", "no"))])
        async_llm.output_processor.process_outputs(outputs)
        with pytest.raises(InvalidPromptError, match="no"):
            await collector.get()
        # The frontend's abort reaches the core on its own time: wait for the engine to go idle
        # (bounded), then check that it freed every block.
        deadline = time.monotonic() + 30
        state = await async_llm.get_block_pool_state()
        while (state.num_running_reqs or state.num_waiting_reqs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            state = await async_llm.get_block_pool_state()
        assert_no_leaked_blocks(state)

    run(main())


def test_n_children_never_collide_with_a_live_id(async_llm) -> None:
    """Item 9: on main "0_abc" was refused while "abc" (n=2) ran, and "abc" while "0_abc" ran."""
    async def main():
        long = SamplingParams(n=2, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
        short = SamplingParams(max_tokens=3, ignore_eos=True)
        parent = await async_llm.add_request("abc", "hello", long)
        single = [o async for o in async_llm.generate("hi", short, "0_abc")]
        assert single[-1].finished
        with pytest.raises(DuplicateRequestError):
            await async_llm.add_request("abc", "hello", long)
        final = await parent.get()
        assert final.finished and len(final.outputs) == 2
        first = await async_llm.add_request("0_x", "hello", SamplingParams(max_tokens=30, ignore_eos=True))
        both = [o async for o in async_llm.generate("hi", SamplingParams(n=2, max_tokens=3, ignore_eos=True), "x")]
        assert [len(c.token_ids) for c in both[-1].outputs] == [3, 3]
        while not (await first.get()).finished:
            pass
        again = [o async for o in async_llm.generate("hi", short, "abc")]  # the id is free again
        assert again[-1].finished
        assert not async_llm.output_processor.parent_requests
        assert_no_leaked_blocks(await async_llm.get_block_pool_state())

    run(main())


def test_a_late_utility_answer_is_dropped_quietly_and_its_kv_events_kept() -> None:
    """Item 10: on main the answer to a cancelled call raised InvalidStateError, losing its events."""
    sink = _AsyncSink()
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.cancel()  # the caller timed out
    sink.pending_calls[3] = (future, bool)
    batch = KVEventBatch(ts=1.0, events=[AllBlocksCleared()])
    sink.on_message(EngineCoreOutputs(utility_output=UtilityOutput(3, msgspec.Raw(msgspec.msgpack.encode(True))),
                                      kv_events=batch))
    assert list(sink.items) and sink.items[0].kv_events == batch and not sink.pending_calls
    sink.items.clear()
    sink.on_message(EngineCoreOutputs())  # a heartbeat: nothing to deliver
    assert not sink.items


def test_a_cancelled_utility_call_leaves_the_engine_serving(async_llm) -> None:
    async def main():
        for _ in range(5):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(async_llm.get_stats(), timeout=0)
        stats = await async_llm.get_stats()
        assert stats.num_running_reqs == 0

    run(main())


def test_errors_are_request_errors_for_the_server(async_llm) -> None:
    """serve maps InvalidRequestError (and its subclasses) to HTTP 400."""
    for cls in (InvalidPromptError, InvalidSamplingParamsError, InvalidRequestIdError, DuplicateRequestError,
                RequestRejectedError):
        assert issubclass(cls, InvalidRequestError) and issubclass(cls, ValueError)
