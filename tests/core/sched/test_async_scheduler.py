"""AsyncScheduler and EngineCore's batch queue over the FakeExecutor (no torch, deterministic).

The FakeExecutor's non-blocking calls are deferred until awaited, so a batch really is in flight
between step_with_batch_queue() scheduling it and popping it. Its tokens depend only on the
request and the position, so sync and async runs must give the same tokens and finish reasons
whatever the batching, stops, aborts and preemptions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from lm_console.engine.core.engine_core import EngineCore
from lm_console.engine.core.sched.async_scheduler import AsyncScheduler
from lm_console.engine.errors import DuplicateRequestError, InvalidEngineArgsError
from lm_console.engine.executor.fake import FakeModelConfig, fake_engine_config, fake_token_id, request_key
from lm_console.engine.protocol import EngineCoreRequest, FinishReason
from lm_console.engine.sampling_params import SamplingParams

VOCAB = 1000


def make_core(async_scheduling: bool, **kwargs) -> EngineCore:  # noqa: ANN003
    kwargs.setdefault("num_blocks", 64)
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("max_model_len", 64)
    model = FakeModelConfig(vocab_size=VOCAB, max_position_embeddings=256)
    return EngineCore(fake_engine_config(model, async_scheduling=async_scheduling, **kwargs))


def request(request_id: str, prompt: list[int], max_tokens: int = 8, eos_token_id: int | None = None,
            **params) -> EngineCoreRequest:  # noqa: ANN003
    return EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
                             eos_token_id=eos_token_id, arrival_time=0.0)


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    key = request_key(0, None, prompt)
    return [fake_token_id(key, len(prompt) + k, VOCAB) for k in range(n)]


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, FinishReason] = field(default_factory=dict)
    num_preempted: int = 0
    max_deferred_frees: int = 0


def drain(core: EngineCore, run: Run | None = None, max_steps: int = 5000,
          on_step=None) -> Run:  # noqa: ANN001
    """Step until the engine has no requests and no batch in flight; collect the outputs."""
    run = run or Run()
    for step in range(max_steps):
        if not core.has_work():
            return run
        outputs, _ = core.step()
        for client_outputs in outputs.values():
            if client_outputs.scheduler_stats is not None:
                run.num_preempted += client_outputs.scheduler_stats.num_preempted_reqs
            for output in client_outputs.outputs:
                assert output.request_id not in run.finish, f"{output.request_id}: output after its finish"
                run.tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                if output.finish_reason is not None:
                    run.finish[output.request_id] = output.finish_reason
        if isinstance(core.scheduler, AsyncScheduler):
            run.max_deferred_frees = max(run.max_deferred_frees, core.scheduler.num_deferred_frees)
        if on_step is not None:
            on_step(step)
    raise AssertionError("the engine did not finish")


def record_batches(core: EngineCore) -> list[int]:
    """The scheduled token count of every batch schedule() builds from now on."""
    sizes: list[int] = []
    schedule = core.scheduler.schedule

    def recording_schedule():  # noqa: ANN202
        output = schedule()
        sizes.append(output.total_num_scheduled_tokens)
        return output

    core.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    return sizes


def assert_idle_and_no_leak(core: EngineCore) -> None:
    assert not core.batch_queue
    state = core.get_block_pool_state()
    assert state.all_free, state
    if isinstance(core.scheduler, AsyncScheduler):
        assert core.scheduler.num_deferred_frees == 0 and not core.scheduler._num_steps_in_flight


def workload(seed: int, num_requests: int = 12) -> list[EngineCoreRequest]:
    """Random prompts and stop conditions: stop tokens and EOS taken from the request's own
    tokens (so they fire), max_tokens, min_tokens, prompts near max_model_len (64), and a shared
    prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(12)]
    requests = []
    for i in range(num_requests):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 40))]
        if rng.random() < 0.3:
            prompt = shared + prompt[:10]
        max_tokens = rng.randrange(1, 30)
        tokens = expected_tokens(prompt, 30)
        kind = rng.randrange(4)
        eos = None
        params: dict = {}
        if kind == 1:
            params["stop_token_ids"] = [tokens[rng.randrange(30)]]
        elif kind == 2:
            eos = tokens[rng.randrange(30)]
            params["min_tokens"] = rng.randrange(0, min(4, max_tokens))
        requests.append(request(f"r{i}", prompt, max_tokens=max_tokens, eos_token_id=eos, **params))
    return requests


def run_workload(async_scheduling: bool, requests: list[EngineCoreRequest], **kwargs) -> tuple[Run, EngineCore]:  # noqa: ANN003
    core = make_core(async_scheduling, **kwargs)
    for r in requests:
        core.add_request(r)
    return drain(core), core


def test_engine_core_picks_the_async_scheduler_and_two_batches() -> None:
    assert isinstance(make_core(True).scheduler, AsyncScheduler)
    assert make_core(True).batch_queue_size == 2
    sync = make_core(False)
    assert not isinstance(sync.scheduler, AsyncScheduler)
    assert sync.batch_queue_size == 1 and sync.batch_queue is None


def test_batch_queue_schedules_step_n_plus_1_before_step_n_returns() -> None:
    core = make_core(True)
    batches = record_batches(core)
    prompt = [5, 6, 7, 8, 9]
    core.add_request(request("a", prompt, max_tokens=4))
    # Step 1: batch 1 (the prefill) is scheduled and submitted; it has not run.
    outputs, executed = core.step()
    assert outputs == {} and executed
    deferred = core.model_executor._deferred
    assert len(core.batch_queue) == 1 and deferred.num_pending == 2  # execute_model + sample_tokens
    req = core.scheduler.requests["a"]
    assert req.num_output_placeholders == 1 and req.num_computed_tokens == 5 and req.num_tokens == 5
    # Step 2: batch 2 (a decode of the token still in flight) is scheduled, then batch 1 popped.
    outputs, _ = core.step()
    assert [o.new_token_ids for o in outputs[0].outputs] == [expected_tokens(prompt, 1)]
    assert len(core.batch_queue) == 1 and deferred.num_pending == 2  # batch 2 still in flight
    assert req.num_computed_tokens == 6 and req.num_tokens == 6 and req.num_output_placeholders == 1
    run = drain(core)
    assert run.tokens["a"] == expected_tokens(prompt, 4)[1:]
    # max_tokens=4: the 4th token is sampled by the 4th batch; no 5th batch computes for it
    # (only an empty one, which tells the worker the request finished).
    assert batches == [5, 1, 1, 1, 0]
    assert_idle_and_no_leak(core)


def test_oldest_batch_pops_first_and_an_empty_schedule_pops_at_once() -> None:
    core = make_core(True)
    core.add_request(request("a", [1, 2, 3], max_tokens=1))
    core.step()  # batch 1: prefill, samples its only token
    # Nothing is left to schedule for "a" (its one token is in flight): the empty batch 2 is
    # queued behind batch 1, and batch 1 pops in the same call.
    outputs, executed = core.step()
    assert not executed
    assert outputs[0].outputs[0].new_token_ids == expected_tokens([1, 2, 3], 1)
    assert outputs[0].outputs[0].finish_reason == FinishReason.LENGTH
    assert len(core.batch_queue) == 1 and core.batch_queue[0][2].total_num_scheduled_tokens == 0
    drain(core)
    assert_idle_and_no_leak(core)


@pytest.mark.parametrize("seed", range(6))
def test_async_equals_sync_on_random_workloads(seed: int) -> None:
    requests = workload(seed)
    sync, sync_core = run_workload(False, requests)
    async_, async_core = run_workload(True, requests)
    assert async_.tokens == sync.tokens
    assert async_.finish == sync.finish
    assert {FinishReason.STOP, FinishReason.LENGTH} <= set(sync.finish.values())
    assert_idle_and_no_leak(sync_core)
    assert_idle_and_no_leak(async_core)


@pytest.mark.parametrize("seed", [0, 4, 6, 8])
def test_async_equals_sync_under_preemption(seed: int) -> None:
    requests = workload(100 + seed, num_requests=14)
    kwargs = dict(num_blocks=20, max_num_batched_tokens=32)  # 19 usable blocks of 4 tokens
    _assert_async_equals_sync_under_preemption(requests, **kwargs)


def _assert_async_equals_sync_under_preemption(requests: list[EngineCoreRequest], **kwargs) -> None:  # noqa: ANN003
    sync, _ = run_workload(False, requests, **kwargs)
    async_, core = run_workload(True, requests, **kwargs)
    assert async_.num_preempted > 0
    differ = [r for r in sync.tokens if async_.tokens.get(r) != sync.tokens[r]]
    assert not differ, f"{len(differ)}/{len(sync.tokens)} requests' tokens differ from sync"
    assert async_.finish == sync.finish
    assert_idle_and_no_leak(core)


def test_a_request_preempted_with_its_stop_token_in_flight_finishes_from_waiting() -> None:
    # Seed 104's workload (found by search) preempts a request whose token in flight stops it.
    requests = workload(104, num_requests=14)
    core = make_core(True, num_blocks=20, max_num_batched_tokens=32)
    removed: list[set[str]] = []
    remove = core.scheduler.waiting.remove_requests

    def recording_remove(reqs):  # noqa: ANN001, ANN202
        removed.append({r.request_id for r in reqs})
        remove(reqs)

    core.scheduler.waiting.remove_requests = recording_remove  # type: ignore[method-assign]
    for r in requests:
        core.add_request(r)
    run = drain(core)
    assert removed  # it left the waiting queue when its last token arrived
    sync, _ = run_workload(False, requests, num_blocks=20, max_num_batched_tokens=32)
    assert run.tokens == sync.tokens and run.finish == sync.finish
    assert_idle_and_no_leak(core)


def test_stop_at_step_n_discards_the_token_of_step_n_plus_1() -> None:
    prompt = [11, 12, 13]
    tokens = expected_tokens(prompt, 10)
    core = make_core(True)
    batches = record_batches(core)
    core.add_request(request("s", prompt, max_tokens=10, stop_token_ids=[tokens[2]]))
    run = drain(core)
    assert run.tokens["s"] == tokens[:3] and run.finish["s"] == FinishReason.STOP
    # The 4th token was being sampled when the 3rd stopped the request: one batch more than
    # the request needed ran, and its token went nowhere.
    assert batches[:4] == [3, 1, 1, 1] and not any(batches[4:])
    assert run.max_deferred_frees == 1  # its blocks waited for that batch
    assert_idle_and_no_leak(core)


def test_abort_mid_stream_frees_blocks_after_the_batches_in_flight() -> None:
    prompts = [[i, i + 1, i + 2, i + 3] for i in range(0, 40, 5)]
    core = make_core(True)
    for i, prompt in enumerate(prompts):
        core.add_request(request(f"r{i}", prompt, max_tokens=20))
    aborted: dict[str, int] = {}
    seen: dict[str, list[int]] = {}

    def abort_some(step: int) -> None:
        if step == 5:
            ids = ["r1", "r4", "r6"]
            for r in ids:
                aborted[r] = len(seen.get(r, []))
            core.abort_requests(ids)
            # Each was in the batch in flight: its blocks wait for it.
            assert core.scheduler.num_deferred_frees == 3
            assert core.get_block_pool_state().num_free_blocks < core.get_block_pool_state().num_blocks - 1

    run = Run()
    run.tokens = seen
    drain(core, run, on_step=abort_some)
    for i, prompt in enumerate(prompts):
        full = expected_tokens(prompt, 20)
        if f"r{i}" in aborted:
            assert seen[f"r{i}"] == full[:aborted[f"r{i}"]]  # nothing after the abort
        else:
            assert seen[f"r{i}"] == full
    assert_idle_and_no_leak(core)


def test_abort_of_a_waiting_request_and_unknown_ids() -> None:
    core = make_core(True, max_num_seqs=1)
    core.add_request(request("a", [1, 2, 3], max_tokens=5))
    core.add_request(request("b", [4, 5, 6], max_tokens=5))
    core.step()
    core.abort_requests(["b", "nope"])
    run = drain(core)
    assert "b" not in run.tokens and run.tokens["a"] == expected_tokens([1, 2, 3], 5)
    assert_idle_and_no_leak(core)


def test_a_finished_id_in_flight_cannot_be_reused_until_its_batch_returns() -> None:
    core = make_core(True)
    core.add_request(request("x", [1, 2, 3], max_tokens=50))
    core.step()
    core.step()
    core.abort_requests(["x"])
    with pytest.raises(DuplicateRequestError, match="step in flight"):
        core.add_request(request("x", [7, 8], max_tokens=2))
    drain(core)
    core.add_request(request("x", [7, 8], max_tokens=2))  # its batches returned: the id is free again
    assert drain(core).tokens["x"] == expected_tokens([7, 8], 2)
    assert_idle_and_no_leak(core)


def test_preempted_request_with_a_token_in_flight_keeps_it_and_resumes() -> None:
    # Two requests, a pool that holds one and a bit: the later one is preempted while its
    # decode is in flight; its token arrives, then it recomputes from all of its tokens.
    core = make_core(True, num_blocks=12, max_model_len=40, max_num_batched_tokens=64)
    prompts = [list(range(1, 17)), list(range(100, 116))]
    for i, prompt in enumerate(prompts):
        core.add_request(request(f"p{i}", prompt, max_tokens=20))
    placeholders_at_preemption: list[int] = []
    preempt = core.scheduler._preempt

    def recording_preempt(req):  # noqa: ANN001, ANN202
        placeholders_at_preemption.append(req.num_output_placeholders)
        preempt(req)
        # A request with a token in flight is not re-admitted before the token arrives.
        assert core.scheduler._get_computed_tokens(req) is None

    core.scheduler._preempt = recording_preempt  # type: ignore[method-assign]
    run = drain(core)
    assert placeholders_at_preemption and all(n > 0 for n in placeholders_at_preemption)
    for i, prompt in enumerate(prompts):
        assert run.tokens[f"p{i}"] == expected_tokens(prompt, 20)
    assert_idle_and_no_leak(core)


def test_prefix_cache_hashes_cover_real_tokens_only() -> None:
    core = make_core(True, block_size=4)
    prompt = list(range(1, 10))  # 9 tokens: 2 full blocks
    core.add_request(request("a", prompt, max_tokens=12))
    for _ in range(6):
        core.step()
        req = core.scheduler.requests["a"]
        # Hashes exist for the full blocks of known tokens, never for a block a placeholder completes.
        assert len(req.block_hashes) == req.num_tokens // 4
        manager = core.kv_cache_manager.coordinator
        num_cached = max(m.num_cached_block.get("a", 0) for m in manager.single_type_managers)
        assert num_cached <= req.num_tokens // 4
    drain(core)
    # A second request with the first one's prompt + output as prompt hits every cached block.
    tokens = prompt + expected_tokens(prompt, 12)
    core.add_request(request("b", tokens, max_tokens=1))
    core.step()
    assert core.scheduler.requests["b"].num_cached_tokens == (len(tokens) - 1) // 4 * 4
    drain(core)
    assert_idle_and_no_leak(core)


def test_async_scheduling_refuses_connectors() -> None:
    from lm_console.engine.config import EngineArgs

    with pytest.raises(InvalidEngineArgsError, match="async_scheduling=True cannot be combined with kv_transfer"):
        EngineArgs(async_scheduling=True, distributed_executor_backend="fake",
                   kv_transfer_config={"kv_connector": "OffloadConnector", "kv_role": "kv_both"})._verify()
    with pytest.raises(InvalidEngineArgsError, match="async_scheduling"):
        EngineArgs(async_scheduling="yes")._verify()  # type: ignore[arg-type]
