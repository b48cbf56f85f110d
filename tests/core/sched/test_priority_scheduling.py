"""scheduling_policy="priority": vLLM's priority-scheduling behaviours (lower value first, ties
by arrival, preemption of the lowest priority and latest arrival), in tests of our own."""

from __future__ import annotations

import pytest

from lm_console.engine.core.kv_cache import KVCacheManager
from lm_console.engine.core.sched.request_queue import FCFSRequestQueue, PriorityRequestQueue, create_request_queue
from lm_console.engine.core.sched.scheduler import Scheduler
from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.engine.kv_cache_hashing import get_request_block_hasher, init_none_hash, sha256_cbor
from lm_console.engine.model_runner_output import ModelRunnerOutput
from lm_console.engine.request import Request, RequestStatus
from lm_console.engine.sampling_params import SamplingParams

BLOCK_SIZE = 16
init_none_hash(sha256_cbor)
HASHER = get_request_block_hasher(BLOCK_SIZE, sha256_cbor)


def make_scheduler(policy: str = "priority", max_num_seqs: int = 16, budget: int = 8192,
                   num_blocks: int = 1000) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=budget, enable_caching=True)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=budget,
                     policy=policy)


def make_requests(priorities: list[int], arrivals: list[float] | None = None, num_tokens: int = 10,
                  first_id: int = 0) -> list[Request]:
    arrivals = arrivals if arrivals is not None else [float(i) for i in range(len(priorities))]
    return [Request(str(first_id + i), [first_id + i] * num_tokens, SamplingParams(max_tokens=16), None,
                    arrival_time=arrival, priority=priority, block_hasher=HASHER)
            for i, (priority, arrival) in enumerate(zip(priorities, arrivals))]


def run_step(scheduler: Scheduler, output) -> None:  # type: ignore[no-untyped-def]
    """One sampled token for every request that finished its prompt this step."""
    req_ids = list(output.num_scheduled_tokens)
    sampled = [[100] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else []
               for r in req_ids]
    scheduler.update_from_output(output, ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled))


def new_ids(output) -> list[str]:  # type: ignore[no-untyped-def]
    return [r.req_id for r in output.scheduled_new_reqs]


@pytest.mark.parametrize(("priorities", "arrivals", "expected"), [
    ([2, 0, 1], [1.0, 2.0, 3.0], ["1", "2", "0"]),  # lower value first
    ([1, 1, 1], [3.0, 1.0, 2.0], ["1", "2", "0"]),  # equal priorities: by arrival
    ([2, 1, 1, 0], [1.0, 3.0, 2.0, 4.0], ["3", "2", "1", "0"]),  # priority, then arrival
    ([1, 1, 1, 1], [4.0, 1.0, 3.0, 2.0], ["1", "3", "2", "0"]),  # all equal: FCFS by arrival
])
def test_admission_order(priorities, arrivals, expected) -> None:
    scheduler = make_scheduler()
    for request in make_requests(priorities, arrivals):
        scheduler.add_request(request)
    assert new_ids(scheduler.schedule()) == expected


def test_fcfs_ignores_priority() -> None:
    scheduler = make_scheduler(policy="fcfs")
    for request in make_requests([2, 0, 1]):
        scheduler.add_request(request)
    assert new_ids(scheduler.schedule()) == ["0", "1", "2"]


@pytest.mark.parametrize(("priorities", "arrivals", "first", "waiting"), [
    ([3, 2, 0], [1.0, 2.0, 3.0], "2", ["1", "0"]),
    ([2, 2, 2], [3.0, 1.0, 2.0], "1", ["2", "0"]),
    ([3, 1, 2, 0], [1.0, 2.0, 3.0, 4.0], "3", ["1", "2", "0"]),
])
def test_one_seat_takes_the_best_and_the_queue_stays_ordered(priorities, arrivals, first, waiting) -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    for request in make_requests(priorities, arrivals):
        scheduler.add_request(request)
    assert new_ids(scheduler.schedule()) == [first]
    assert [r.request_id for r in scheduler.waiting] == waiting


def test_limited_seats_take_the_two_best() -> None:
    scheduler = make_scheduler(max_num_seqs=2, budget=1000)
    for request in make_requests([3, 1, 2, 0]):
        scheduler.add_request(request)
    assert sorted(new_ids(scheduler.schedule())) == ["1", "3"]
    assert [(r.request_id, r.priority) for r in scheduler.waiting] == [("2", 2), ("0", 3)]


def test_heap_order_one_at_a_time() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    priorities = [5, 1, 8, 3, 2, 7, 4, 6]
    for request in make_requests(priorities):
        scheduler.add_request(request)
    order = []
    while scheduler.waiting:
        output = scheduler.schedule()
        (request_id,) = new_ids(output)
        order.append(priorities[int(request_id)])
        run_step(scheduler, output)
        scheduler.finish_requests(request_id, RequestStatus.FINISHED_STOPPED)
    assert order == sorted(priorities)


def test_no_preemption_when_there_is_room() -> None:
    scheduler = make_scheduler(max_num_seqs=3, budget=200)
    low = make_requests([5, 5], num_tokens=30)
    for request in low:
        scheduler.add_request(request)
    run_step(scheduler, scheduler.schedule())
    high, = make_requests([0], [3.0], num_tokens=30, first_id=2)
    scheduler.add_request(high)
    output = scheduler.schedule()
    assert new_ids(output) == ["2"] and not output.preempted_req_ids
    assert len(scheduler.running) == 3 and len(scheduler.waiting) == 0


def test_a_waiting_request_of_higher_priority_preempts_the_lowest_latest() -> None:
    # 6 usable blocks; three low-priority requests of 30 tokens hold 2 blocks each.
    scheduler = make_scheduler(max_num_seqs=4, budget=200, num_blocks=7)
    low = make_requests([5, 7, 7], [1.0, 2.0, 3.0], num_tokens=30)
    for request in low:
        scheduler.add_request(request)
    run_step(scheduler, scheduler.schedule())
    assert len(scheduler.running) == 3 and scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    high, = make_requests([0], [4.0], num_tokens=30, first_id=3)
    scheduler.add_request(high)
    output = scheduler.schedule()
    # The running phase fits (the decodes' 31st tokens fit their 2nd blocks); admitting the new
    # request preempts "2" (priority 7, the latest of the two 7s), whose blocks then suffice.
    assert output.preempted_req_ids == {"2"} and new_ids(output) == ["3"]
    assert "2" not in output.num_scheduled_tokens  # unscheduled: it had a decode this step
    assert scheduler.requests["2"].status == RequestStatus.PREEMPTED
    assert [r.request_id for r in scheduler.waiting] == ["2"]
    assert sorted(r.request_id for r in scheduler.running) == ["0", "1", "3"]
    assert sum(output.num_scheduled_tokens.values()) == output.total_num_scheduled_tokens == 1 + 1 + 30


def test_equal_or_lower_priority_never_preempts() -> None:
    scheduler = make_scheduler(max_num_seqs=4, budget=200, num_blocks=5)
    for request in make_requests([1, 1], num_tokens=30):
        scheduler.add_request(request)
    run_step(scheduler, scheduler.schedule())
    same, = make_requests([1], [0.5], num_tokens=30, first_id=2)  # earlier arrival, same priority
    scheduler.add_request(same)
    output = scheduler.schedule()
    assert not output.preempted_req_ids and new_ids(output) == []
    assert [r.request_id for r in scheduler.waiting] == ["2"]


def test_a_full_seat_count_is_preempted_for_a_higher_priority() -> None:
    scheduler = make_scheduler(max_num_seqs=2, budget=200)
    for request in make_requests([3, 4]):
        scheduler.add_request(request)
    run_step(scheduler, scheduler.schedule())
    high, = make_requests([0], [5.0], first_id=2)
    scheduler.add_request(high)
    output = scheduler.schedule()
    assert output.preempted_req_ids == {"1"} and new_ids(output) == ["2"]


def test_running_phase_preempts_the_lowest_priority_and_resumes_it() -> None:
    """vLLM's preemption-and-resumption case: 4 usable blocks of 16 tokens."""
    scheduler = make_scheduler(max_num_seqs=2, budget=200, num_blocks=5)
    low, = make_requests([1], [0.0], num_tokens=30)
    scheduler.add_request(low)
    output = scheduler.schedule()
    assert new_ids(output) == ["0"]
    run_step(scheduler, output)  # 31 tokens: 2 blocks
    high, = make_requests([0], [1.0], num_tokens=32, first_id=1)
    scheduler.add_request(high)
    output = scheduler.schedule()
    assert new_ids(output) == ["1"] and output.scheduled_cached_reqs.req_ids == ["0"]
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    run_step(scheduler, output)
    # Next step: "0" needs nothing new (32 tokens in 2 blocks) but "1" needs a 3rd block for its
    # 33rd token. "0" comes first in `running`, is scheduled, then preempted for "1": unscheduled.
    output = scheduler.schedule()
    assert output.preempted_req_ids == {"0"} and output.scheduled_cached_reqs.req_ids == ["1"]
    assert list(output.num_scheduled_tokens) == ["1"] and output.total_num_scheduled_tokens == 1
    assert scheduler.requests["0"].status == RequestStatus.PREEMPTED
    assert len(scheduler.waiting) == 1 and len(scheduler.running) == 1
    run_step(scheduler, output)
    scheduler.finish_requests("1", RequestStatus.FINISHED_STOPPED)
    output = scheduler.schedule()  # "0" resumes: recomputes its 30 prompt + 2 output tokens
    resumed, = output.scheduled_new_reqs  # its prefix-cache hit, then the rest
    assert resumed.req_id == "0" and resumed.num_computed_tokens + output.num_scheduled_tokens["0"] == 32
    assert output.scheduled_new_reqs[0].output_token_ids == [100, 100]


def test_fcfs_running_phase_still_preempts_the_latest_arrival() -> None:
    scheduler = make_scheduler(policy="fcfs", max_num_seqs=2, budget=200, num_blocks=5)
    low, = make_requests([1], [0.0], num_tokens=30)
    scheduler.add_request(low)
    run_step(scheduler, scheduler.schedule())
    high, = make_requests([0], [1.0], num_tokens=32, first_id=1)
    scheduler.add_request(high)
    run_step(scheduler, scheduler.schedule())
    output = scheduler.schedule()
    assert output.preempted_req_ids == {"1"}  # the latest arrival, whatever its priority


def test_queues() -> None:
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    assert isinstance(create_request_queue("priority"), PriorityRequestQueue)
    with pytest.raises(InvalidEngineArgsError, match="scheduling_policy='lifo'"):
        create_request_queue("lifo")
    queue = PriorityRequestQueue()
    a, b, c = make_requests([1, 0, 1], [1.0, 2.0, 0.5])
    for request in (a, b, c):
        queue.add_request(request)
    queue.remove_requests({c})
    assert [r.request_id for r in queue] == ["1", "0"] and len(queue) == 2
    queue.prepend_request(c)  # a preempted request goes back under its own key
    assert queue.pop_request() is b and queue.peek_request() is c


def test_a_victim_ahead_in_the_running_list_does_not_make_the_next_request_skip_its_step() -> None:
    """A running request that needs a block preempts a lower-priority one that sits before it in
    the running list: the list shifts left, and the request after it still gets its token."""
    kv = KVCacheManager(num_blocks=5, block_size=4, max_model_len=64, enable_caching=True)  # 4 usable blocks
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, policy="priority")
    hasher = get_request_block_hasher(4, sha256_cbor)
    low = Request("low", [1] * 6, SamplingParams(max_tokens=16), None, arrival_time=0.0, priority=1,
                  block_hasher=hasher)
    scheduler.add_request(low)
    run_step(scheduler, scheduler.schedule())  # low: 2 blocks
    for request_id in ("h1", "h2"):
        scheduler.add_request(Request(request_id, [2] * 4, SamplingParams(max_tokens=16), None, arrival_time=1.0,
                                      priority=0, block_hasher=hasher))
    second = scheduler.schedule()  # h1 and h2 admitted with a block each: the cache is full
    assert set(second.num_scheduled_tokens) == {"low", "h1", "h2"}
    run_step(scheduler, second)
    third = scheduler.schedule()  # h1's token 5 needs a block: low (before it in running) goes
    assert third.preempted_req_ids == {"low"}
    assert third.num_scheduled_tokens == {"h1": 1, "h2": 1}


def test_fcfs_a_waiting_request_of_higher_priority_preempts_no_one() -> None:
    """FCFS ignores priorities in admission too: a waiting request with a better priority
    value waits for a seat or for blocks instead of preempting a running one."""
    for max_num_seqs, num_blocks in ((1, 1000), (8, 3)):  # no seat; no blocks (2 usable of 16 tokens)
        scheduler = make_scheduler(policy="fcfs", max_num_seqs=max_num_seqs, num_blocks=num_blocks)
        low, = make_requests([5], [0.0], num_tokens=20)
        scheduler.add_request(low)
        run_step(scheduler, scheduler.schedule())
        high, = make_requests([0], [1.0], num_tokens=20, first_id=1)
        scheduler.add_request(high)
        output = scheduler.schedule()
        assert output.preempted_req_ids == set(), (max_num_seqs, num_blocks)
        assert set(output.num_scheduled_tokens) == {"0"} and [r.request_id for r in scheduler.waiting] == ["1"]
