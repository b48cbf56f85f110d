"""Scheduler: token budget, chunked prefill, preemption, stop checks, and no leaked blocks."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lm_console.engine.core.kv_cache import KVCacheManager
from lm_console.engine.kv_cache_hashing import get_request_block_hasher, init_none_hash, sha256_cbor
from lm_console.engine.core.sched.async_scheduler import AsyncScheduler
from lm_console.engine.core.sched.scheduler import Scheduler
from lm_console.engine.request import Request, RequestStatus
from lm_console.engine.sampling_params import SamplingParams
from lm_console.engine.model_runner_output import ModelRunnerOutput
from lm_console.engine.protocol import LogprobsLists

BLOCK_SIZE = 4
EOS = 2
init_none_hash(sha256_cbor)
HASHER = get_request_block_hasher(BLOCK_SIZE, sha256_cbor)


def make_scheduler(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 32,
                   max_model_len: int = 64, caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=max_model_len,
                        enable_caching=caching)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=max_model_len)


def make_request(request_id: str, prompt: list[int], max_tokens: int = 4, **params) -> Request:
    return Request(request_id=request_id, prompt_token_ids=prompt,
                   sampling_params=SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_id=EOS, block_hasher=HASHER)


def fake_output(scheduler_output, requests: dict[str, Request], next_token) -> ModelRunnerOutput:
    """What a ModelRunner returns: a token for every request whose prompt is fully computed."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens  # scheduler already advanced
        sampled.append([next_token(request)] if done else [])
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=sampled)


def run_step(scheduler: Scheduler, next_token=lambda r: 7):
    requests = dict(scheduler.requests)
    scheduler_output = scheduler.schedule()
    outputs = scheduler.update_from_output(scheduler_output, fake_output(scheduler_output, requests, next_token))
    return scheduler_output, outputs


def assert_no_leak(scheduler: Scheduler) -> None:
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_token_budget_and_chunked_prefill() -> None:
    scheduler = make_scheduler(budget=16)
    scheduler.add_request(make_request("a", list(range(10, 50))))  # 40 prompt tokens
    first, _ = run_step(scheduler)
    assert first.num_scheduled_tokens == {"a": 16}
    second, outputs = run_step(scheduler)
    assert second.num_scheduled_tokens == {"a": 16}
    assert not outputs  # still prefilling: nothing sampled
    third, outputs = run_step(scheduler)
    assert third.num_scheduled_tokens == {"a": 8}
    assert outputs[0].outputs[0].new_token_ids == [7]


def test_running_requests_are_served_before_waiting_ones() -> None:
    scheduler = make_scheduler(budget=20)
    scheduler.add_request(make_request("a", list(range(10, 22)), max_tokens=8))
    run_step(scheduler)
    scheduler.add_request(make_request("b", list(range(30, 60)), max_tokens=8))
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1, "b": 19}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["b"]
    assert out.scheduled_cached_reqs.req_ids == ["a"]


def test_stop_on_eos_max_tokens_and_stop_token_ids() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("eos", [5, 6, 7], max_tokens=10))
    scheduler.add_request(make_request("len", [5, 6, 8], max_tokens=2))
    scheduler.add_request(make_request("tok", [5, 6, 9], max_tokens=10, stop_token_ids=[11]))
    scheduler.requests["tok"].sampling_params.all_stop_token_ids = {11}
    tokens = {"eos": EOS, "len": 7, "tok": 11}
    finished = {}
    for _ in range(3):
        _, outputs = run_step(scheduler, lambda r: tokens[r.request_id])
        for output in outputs.get(0, []).outputs if outputs else []:
            if output.finish_reason is not None:
                finished[output.request_id] = (str(output.finish_reason), output.stop_reason)
    assert finished == {"eos": ("stop", None), "len": ("length", None), "tok": ("stop", 11)}
    assert not scheduler.has_unfinished_requests()
    assert_no_leak(scheduler)


def test_min_tokens_and_ignore_eos_suppress_eos() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("min", [5, 6, 7], max_tokens=5, min_tokens=3))
    scheduler.add_request(make_request("ign", [5, 6, 8], max_tokens=4, ignore_eos=True))
    counts = {}
    while scheduler.has_unfinished_requests():
        _, outputs = run_step(scheduler, lambda r: EOS)
        for output in outputs[0].outputs:
            counts[output.request_id] = counts.get(output.request_id, 0) + len(output.new_token_ids)
    assert counts == {"min": 3, "ign": 4}


def test_preemption_frees_blocks_and_recomputes() -> None:
    # 8 usable blocks of 4 tokens: two requests of 12 prompt tokens cannot both grow far.
    scheduler = make_scheduler(num_blocks=9, budget=64, max_model_len=32)
    scheduler.add_request(make_request("a", list(range(10, 22)), max_tokens=16))
    scheduler.add_request(make_request("b", list(range(40, 52)), max_tokens=16))
    preempted = set()
    steps = 0
    while scheduler.has_unfinished_requests():
        out, _ = run_step(scheduler)
        preempted |= out.preempted_req_ids
        steps += 1
        assert steps < 200
    assert preempted == {"b"}  # FCFS: the latest arrival is preempted
    assert_no_leak(scheduler)


def test_abort_waiting_and_running() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", [5, 6, 7], max_tokens=10))
    scheduler.add_request(make_request("b", [5, 6, 8], max_tokens=10))
    run_step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["a"]
    scheduler.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests()
    out = scheduler.schedule()
    assert out.finished_req_ids == {"a", "b"}
    assert_no_leak(scheduler)


def test_prefix_hit_reported_in_num_cached_tokens() -> None:
    scheduler = make_scheduler()
    prompt = list(range(100, 117))  # 17 tokens: 4 full blocks
    scheduler.add_request(make_request("a", prompt, max_tokens=1))
    run_step(scheduler)
    scheduler.add_request(make_request("b", prompt, max_tokens=1))
    out, outputs = run_step(scheduler)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16
    assert out.num_scheduled_tokens == {"b": 1}
    assert outputs[0].outputs[0].num_cached_tokens == 16


def test_num_cached_tokens_is_the_first_admission_s_hit_after_a_preemption() -> None:
    """"b" starts with an 8-token prefix hit; preempted (its blocks partly evicted), it is admitted
    again with another hit, but its outputs keep reporting the prompt tokens the cache saved: 8."""
    scheduler = make_scheduler(num_blocks=9, budget=64, max_model_len=32)
    prefix = list(range(40, 48))
    scheduler.add_request(make_request("w", prefix, max_tokens=1))
    run_step(scheduler)
    scheduler.add_request(make_request("a", list(range(10, 22)), max_tokens=16))
    scheduler.add_request(make_request("b", prefix + [60, 61, 62, 63], max_tokens=16))
    readmitted_with, preempted, cached = [], set(), set()
    while scheduler.has_unfinished_requests():
        out, outputs = run_step(scheduler)
        preempted |= out.preempted_req_ids
        readmitted_with += [r.num_computed_tokens for r in out.scheduled_new_reqs if r.req_id == "b"]
        cached |= {o.num_cached_tokens for o in (outputs[0].outputs if outputs else []) if o.request_id == "b"}
    assert preempted == {"b"} and len(readmitted_with) == 2 and readmitted_with[0] == 8 != readmitted_with[1]
    assert cached == {8}
    assert_no_leak(scheduler)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_add_abort_finish_never_leaks(data) -> None:
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    scheduler = make_scheduler(num_blocks=data.draw(st.integers(9, 40)),
                               max_num_seqs=data.draw(st.integers(1, 6)),
                               budget=data.draw(st.sampled_from([8, 16, 64])), max_model_len=32)
    shared_prefix = [rng.randrange(10, 50) for _ in range(8)]
    next_id = 0
    for _ in range(data.draw(st.integers(1, 40))):
        action = rng.random()
        if action < 0.4:
            prompt_len = rng.randint(1, 20)
            prompt = (shared_prefix if rng.random() < 0.5 else []) + [rng.randrange(10, 50) for _ in range(prompt_len)]
            prompt = prompt[:28]
            scheduler.add_request(make_request(str(next_id), prompt, max_tokens=rng.randint(1, 8)))
            next_id += 1
        elif action < 0.55 and scheduler.requests:
            victim = rng.choice(list(scheduler.requests))
            scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        else:
            run_step(scheduler, lambda r: rng.choice([EOS, 7, 8, 9]))
        # Invariant: every running request holds blocks covering its computed tokens.
        for request in scheduler.running:
            blocks = scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
            assert len(blocks) * BLOCK_SIZE >= request.num_computed_tokens
    steps = 0
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
        steps += 1
        assert steps < 500
    assert_no_leak(scheduler)


def test_prompt_logprob_rows_go_out_once_across_chunks_and_a_recompute() -> None:
    """Each prompt position's logprob row reaches the frontend exactly once, in order: chunked
    prefill sends them piece by piece, and a preempted request recomputes its prompt from 0,
    so the runner produces rows the frontend already has (they must not go out again)."""
    # 8 usable blocks of 4 tokens, 8 tokens a step: b's 24-token prompt goes in chunks, and b
    # is preempted before its prefill ends (a's decode holds the blocks it needs), then
    # prefilled again in chunks that straddle the rows already sent.
    scheduler = make_scheduler(num_blocks=9, budget=8, max_model_len=32)
    prompts = {"a": list(range(10, 22)), "b": list(range(40, 64))}
    for request_id, prompt in prompts.items():
        scheduler.add_request(make_request(request_id, prompt, max_tokens=16, prompt_logprobs=1))
    received: dict[str, list[int]] = {"a": [], "b": []}
    produced: dict[str, list[int]] = {"a": [], "b": []}
    preempted: set[str] = set()
    partial = [False]
    steps = 0
    while scheduler.has_unfinished_requests():
        requests = dict(scheduler.requests)
        out = scheduler.schedule()
        preempted |= out.preempted_req_ids
        runner_output = fake_output(out, requests, lambda r: 7)
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            # Row i: the logprob of prompt token i + 1 (positions 0 .. len(prompt) - 2).
            start = requests[request_id].num_computed_tokens - num_tokens
            rows = list(range(start, min(start + num_tokens, len(prompts[request_id]) - 1)))
            if rows:
                produced[request_id] += rows
                runner_output.prompt_logprobs[request_id] = (start, LogprobsLists(
                    [[row] for row in rows], [[-float(row)] for row in rows], rows))
        for request_id, (start, lists) in runner_output.prompt_logprobs.items():
            sent = scheduler.requests[request_id].num_prompt_logprobs_sent
            partial[0] |= start < sent < start + len(lists.sampled_token_ranks)
        for outputs in scheduler.update_from_output(out, runner_output).values():
            for output in outputs.outputs:
                if output.new_prompt_logprobs is not None:
                    lists = output.new_prompt_logprobs
                    assert lists.logprob_token_ids == [[row] for row in lists.sampled_token_ranks]
                    received[output.request_id] += lists.sampled_token_ranks
        steps += 1
        assert steps < 200
    assert preempted == {"b"}
    assert len(produced["b"]) > len(prompts["b"]) - 1  # the recompute produced rows again
    assert partial[0], "no recomputed chunk straddled the rows already sent"
    assert received == {request_id: list(range(len(prompt) - 1))
                        for request_id, prompt in prompts.items()}
    assert_no_leak(scheduler)


def test_stats_before_the_first_step_count_nothing() -> None:
    stats = make_scheduler().make_stats()
    assert (stats.num_scheduled_tokens, stats.num_prompt_tokens, stats.num_generation_tokens,
            stats.num_preempted_reqs, stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0, 0, 0, 0, 0)


def test_a_stop_inside_a_multi_token_step_keeps_the_logprobs_of_the_tokens_kept() -> None:
    """A step that samples several tokens (speculative decoding) and stops at the second: the
    output has the first two tokens and their two logprob rows, not the rows of the tokens
    dropped after the stop."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [5, 6, 7], max_tokens=10, logprobs=1))
    out = scheduler.schedule()
    sampled = [7, EOS, 9]
    rows = LogprobsLists([[t] for t in sampled], [[-float(i)] for i in range(3)], [0, 1, 2])
    runner_output = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[sampled],
                                      logprobs={"a": rows})
    [output] = scheduler.update_from_output(out, runner_output)[0].outputs
    assert output.new_token_ids == [7, EOS]
    assert output.new_logprobs == LogprobsLists([[7], [EOS]], [[-0.0], [-1.0]], [0, 1])
    assert_no_leak(scheduler)


def test_async_blocks_of_an_aborted_request_wait_for_its_last_step_in_flight() -> None:
    """Three steps of a request in flight, then an abort: its blocks stay held until the third
    step has returned (each step writes them), and only then go back to the pool."""
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE, max_model_len=64)
    scheduler = AsyncScheduler(kv, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64)
    scheduler.add_request(make_request("a", [5, 6, 7, 8, 9], max_tokens=20))
    steps = []
    for _ in range(3):
        requests = dict(scheduler.requests)
        out = scheduler.schedule()
        assert out.num_scheduled_tokens == {"a": 5 if not steps else 1}
        steps.append((out, fake_output(out, requests, lambda r: 7)))
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    pool = kv.block_pool
    for returned, (out, runner_output) in enumerate(steps, start=1):
        scheduler.update_from_output(out, runner_output)
        held = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
        if returned < 3:
            assert held > 0, f"blocks freed after {returned} of 3 steps in flight returned"
    assert_no_leak(scheduler)


def test_without_chunked_prefill_a_prompt_that_does_not_fit_the_budget_left_waits_whole() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE, max_model_len=64)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64,
                          enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", list(range(10, 20)), max_tokens=2))
    scheduler.add_request(make_request("b", list(range(30, 40)), max_tokens=2))
    first, _ = run_step(scheduler)
    assert first.num_scheduled_tokens == {"a": 10}  # b's 10 tokens do not fit the 6 left: no chunk
    second, _ = run_step(scheduler)
    assert second.num_scheduled_tokens == {"a": 1, "b": 10}
