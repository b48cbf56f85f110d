"""Greedy outputs (fp32) with async_scheduling on equal those with it off, on the tiny Llama and
the embedded model: max_tokens, stop token ids, stop strings, EOS, n > 1, prefix hits, forced
preemption, aborts mid-stream; no KV block leaks. The tiny-model engines run in-process (cheap),
so the tests also drive the async LLM's EngineCore directly (its UniProcExecutor's worker thread
and the runner's device-side placeholder inputs); the slow test runs the core in its own process."""

from __future__ import annotations

import pytest

from lm_console.engine import LLM, SamplingParams
from lm_console.engine.core.engine_core import EngineCore
from lm_console.engine.protocol import EngineCoreRequest
from broken_variants import rank1_attention_zeroed
from llm_helpers import assert_aborts_cut_outputs, assert_all_equal, assert_no_leaked_blocks, random_prompts, text_prompts

pytestmark = pytest.mark.slow


def _outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):  # noqa: ANN202
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs] for o in outputs]


# In-process cores keep the module cheap; the slow test below runs the core in its own process.
ENGINE = dict(dtype="float32", multiprocess=False)


@pytest.fixture(scope="module")
def llms(tiny_llama_dir):  # noqa: ANN201
    sync = LLM(str(tiny_llama_dir), **ENGINE)
    async_ = LLM(str(tiny_llama_dir), async_scheduling=True, **ENGINE)
    yield sync, async_
    for llm in (sync, async_):
        assert_no_leaked_blocks(llm)
        llm.shutdown()


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir) -> list[list[int]]:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_llama_dir).vocab_size
    return random_prompts(vocab, 8, 5, 100, seed=3)


FREE = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def free_outputs(llms, prompts):  # noqa: ANN001, ANN201
    """The sync engine's greedy outputs, no stop condition but max_tokens."""
    return _outputs(llms[0], prompts, FREE)


def test_async_config_reaches_the_core(llms) -> None:  # noqa: ANN001
    sync, async_ = llms
    assert async_.config.scheduler_config.async_scheduling
    assert not sync.config.scheduler_config.async_scheduling


def test_greedy_equal_with_every_stop_condition(llms, prompts, free_outputs) -> None:  # noqa: ANN001
    """max_tokens, stop token ids and stop strings that fire mid-output, EOS with min_tokens, logprobs."""
    sync, async_ = llms
    params = []
    for i, out in enumerate(free_outputs):
        tokens, text = out[0][0], out[0][3]
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=1 + i, ignore_eos=True, logprobs=2))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                         stop_token_ids=[tokens[3 + i % 5]]))
        elif kind == 2 and len(text) > 8:
            params.append(SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                         stop=[text[len(text) // 2: len(text) // 2 + 3]]))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=16, min_tokens=2))
    expected = _outputs(sync, prompts, params)
    assert_all_equal(_outputs(async_, prompts, params), expected, "async vs sync")
    assert [o[0][1] for o in expected].count("stop") >= 3  # the stop conditions did fire


def test_n_greater_than_one_greedy_and_seeded(llms, prompts) -> None:  # noqa: ANN001
    sync, async_ = llms
    params = [SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(n=2, temperature=0.9, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)]
    expected = _outputs(sync, prompts[:2], params)
    assert _outputs(async_, prompts[:2], params) == expected
    assert [len(o) for o in expected] == [3, 2]


def test_prefix_hits_do_not_change_outputs(llms, prompts) -> None:  # noqa: ANN001
    sync, async_ = llms
    prefix = [t for p in prompts for t in p][:48]
    shared = [prefix + p[:10] for p in prompts[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = _outputs(sync, shared, params)
    assert _outputs(async_, shared, params) == expected
    # Again: every prompt now hits the prefix cache.
    again = async_.generate([{"prompt_token_ids": p} for p in shared], params, use_tqdm=False)
    assert [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs] for o in again] == expected
    assert all(o.num_cached_tokens >= 48 for o in again)


def test_forced_preemption_does_not_change_outputs(prompts, free_outputs, make_llm, tiny_llama_dir) -> None:  # noqa: ANN001
    # 12 usable blocks of 16 tokens for 8 requests of up to 116 tokens: preemptions.
    small = make_llm(str(tiny_llama_dir), async_scheduling=True, num_gpu_blocks_override=13, max_model_len=192,
                     **ENGINE)
    assert_all_equal(_outputs(small, prompts, FREE), free_outputs, "async under preemption vs sync")
    assert small.get_stats().num_preemptions_total > 0


def test_negative_control_rank1_attention_zeroed_fails_the_async_check(prompts, free_outputs, make_llm,  # noqa: ANN001
                                                                      tiny_llama_dir) -> None:
    """The async-vs-sync check on an async engine (a fresh one: its prefix cache must not outlive
    the fault) whose rank-1 heads lost their attention (tests/broken_variants.py) must fail."""
    with rank1_attention_zeroed():
        broken = _outputs(make_llm(str(tiny_llama_dir), async_scheduling=True, **ENGINE), prompts, FREE)
    with pytest.raises(AssertionError, match="exactly equal"):
        assert_all_equal(broken, free_outputs, "async vs sync")


# -- the async LLM's EngineCore, driven directly ------------------------------------------------
def _core(llm: LLM) -> EngineCore:
    return llm.engine_core.engine_core  # InprocClient


def _drain(core: EngineCore, on_step=None) -> dict[str, list[int]]:  # noqa: ANN001
    tokens: dict[str, list[int]] = {}
    step = 0
    while core.has_work():
        outputs, _ = core.step()
        for client_outputs in outputs.values():
            for output in client_outputs.outputs:
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        if on_step is not None:
            on_step(step, tokens)
        step += 1
    return tokens


def _add(core: EngineCore, prompts: list[list[int]]) -> list[str]:
    ids = [f"core-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        core.add_request(EngineCoreRequest(request_id, prompt, FREE, eos_token_id=None, arrival_time=0.0))
    return ids


def _assert_core_idle_and_no_leak(core: EngineCore) -> None:
    state = core.get_block_pool_state()
    assert state.num_free_blocks == state.num_blocks - 1 and not core.batch_queue


def test_uniproc_runs_the_worker_on_its_own_thread(llms) -> None:  # noqa: ANN001
    executor = _core(llms[1]).model_executor
    assert executor.max_concurrent_batches == 2 and executor.worker_thread is not None
    names = executor.collective_rpc(lambda worker: __import__("threading").current_thread().name)
    assert names[0].startswith("lmc-worker")
    assert _core(llms[0]).batch_queue is None and _core(llms[0]).model_executor.worker_thread is None


def test_placeholder_inputs_come_from_the_previous_samples_on_the_device(llms, prompts, free_outputs) -> None:  # noqa: ANN001
    """The host copy of each sampled token is overwritten with garbage right after sampling: the
    outputs stay right only if the next step takes its input from the device-side samples."""
    core = _core(llms[1])
    runner = core.model_executor.worker.model_runner
    sample_tokens, copy = runner.sample_tokens, runner._copy_prev_sampled_token_ids
    num_copied: list[int] = []

    def poisoning_sample_tokens():  # noqa: ANN202
        output = sample_tokens()
        for row, position in runner.prev_sampled.values():
            runner.input_batch.token_ids_cpu[row, position] = 0
        return output

    def counting_copy(inputs):  # noqa: ANN001, ANN202
        copy(inputs)
        num_copied.append(sum(1 for r in inputs.req_ids if r in runner.prev_sampled))

    runner.sample_tokens, runner._copy_prev_sampled_token_ids = poisoning_sample_tokens, counting_copy
    try:
        ids = _add(core, prompts)
        tokens = _drain(core)
    finally:
        del runner.sample_tokens, runner._copy_prev_sampled_token_ids
    assert [tokens[i] for i in ids] == [out[0][0] for out in free_outputs]
    assert sum(num_copied) >= len(prompts) * 14  # every decode input (15 a request) but the last few
    _assert_core_idle_and_no_leak(core)


def test_abort_mid_stream_emits_nothing_more_and_frees_every_block(llms, prompts, free_outputs) -> None:  # noqa: ANN001
    core = _core(llms[1])
    emitted_at_abort: dict[str, int] = {}

    def abort(step: int, tokens: dict[str, list[int]]) -> None:
        if step == 4:
            for request_id in ("core-1", "core-3"):
                emitted_at_abort[request_id] = len(tokens.get(request_id, []))
            core.abort_requests(list(emitted_at_abort))
            assert core.scheduler.num_deferred_frees == 2  # both were in the batch in flight

    ids = _add(core, prompts)
    tokens = _drain(core, abort)
    assert_aborts_cut_outputs(tokens, ids, [out[0][0] for out in free_outputs], emitted_at_abort)
    _assert_core_idle_and_no_leak(core)


@pytest.mark.slow
def test_embedded_model_greedy_equal(embedded_model_dir, make_llm) -> None:  # noqa: ANN001
    # The async engine core runs in its own process here (the default), as under `lmc serve`.
    sync = make_llm(None, **ENGINE)
    prompts = text_prompts(sync.get_tokenizer(), 3, 5, 200)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    expected = _outputs(sync, prompts, params)
    async_ = make_llm(None, dtype="float32", async_scheduling=True)
    assert _outputs(async_, prompts, params) == expected
