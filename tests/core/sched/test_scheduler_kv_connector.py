"""Scheduler + KV connector: ext_comp in allocate_slots, WAITING_FOR_REMOTE_KVS, load errors,
delayed free, (None, _) answers, kv_transfer_params; no leaked blocks on any path."""

from __future__ import annotations

from types import SimpleNamespace

from lm_console.engine.distributed.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from lm_console.engine.config.kv_transfer import KVTransferConfig
from lm_console.engine.distributed.kv_transfer.output import KVConnectorOutput
from lm_console.engine.request import RequestStatus
from lm_console.engine.model_runner_output import ModelRunnerOutput

from test_scheduler import BLOCK_SIZE, assert_no_leak, fake_output, make_request, make_scheduler


class FakeConnector(KVConnectorBase):
    """Scheduler role only: answers from `matches`, records what the scheduler told it."""

    def __init__(self) -> None:
        super().__init__(SimpleNamespace(), KVConnectorRole.SCHEDULER, KVTransferConfig("Fake"))
        self.matches: dict[str, tuple[int | None, bool]] = {}
        self.allocs: list[tuple[str, list[int], int]] = []
        self.finished: list[str] = []
        self.delay_free = False

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.matches.get(request.request_id, (0, False))

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.allocs.append((request.request_id, blocks.get_block_ids()[0], num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        return self.delay_free, {"done": request.request_id}

    def start_load_kv(self, forward_context): ...
    def wait_for_layer_load(self, layer_name): ...
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata): ...
    def wait_for_save(self): ...


def step(scheduler, kv_output: KVConnectorOutput | None = None):
    requests = dict(scheduler.requests)
    scheduler_output = scheduler.schedule()
    output = fake_output(scheduler_output, requests, lambda r: 7)
    output.kv_connector_output = kv_output
    return scheduler_output, scheduler.update_from_output(scheduler_output, output)


def finish(scheduler, limit: int = 50) -> None:
    for _ in range(limit):
        if not scheduler.has_unfinished_requests():
            return
        step(scheduler)
    raise AssertionError("requests did not finish")


def make(connector: FakeConnector):
    scheduler = make_scheduler()
    scheduler._init_kv_connector_state(connector)
    return scheduler


def test_async_load_waits_then_resumes_with_cached_blocks() -> None:
    connector = FakeConnector()
    scheduler = make(connector)
    request = make_request("a", list(range(10, 34)), max_tokens=2)
    connector.matches["a"] = (16, True)
    scheduler.add_request(request)
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {} and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert connector.allocs == [("a", connector.allocs[0][1], 16)] and len(connector.allocs[0][1]) == 4
    out, _ = step(scheduler)  # nothing arrived yet: still waiting, asked nothing new
    assert out.num_scheduled_tokens == {} and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(scheduler, KVConnectorOutput(finished_recving={"a"}))
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 8} and request.num_cached_tokens == 16
    assert scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block  # the loaded blocks are cached
    finish(scheduler)
    assert connector.finished == ["a"]
    assert_no_leak(scheduler)


def test_load_error_recomputes_from_the_first_invalid_block() -> None:
    connector = FakeConnector()
    scheduler = make(connector)
    request = make_request("a", list(range(10, 34)), max_tokens=2)
    connector.matches["a"] = (20, True)
    scheduler.add_request(request)
    step(scheduler)
    block_ids = scheduler.kv_cache_manager.get_block_ids("a")[0]
    step(scheduler, KVConnectorOutput(finished_recving={"a"}, invalid_block_ids={block_ids[2]}))
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 24 - 2 * BLOCK_SIZE}
    finish(scheduler)
    assert_no_leak(scheduler)


def test_none_answer_is_asked_again_and_others_proceed() -> None:
    connector = FakeConnector()
    scheduler = make(connector)
    connector.matches["a"] = (None, False)
    scheduler.add_request(make_request("a", list(range(10, 20))))
    scheduler.add_request(make_request("b", list(range(40, 50))))
    out, _ = step(scheduler)
    assert set(out.num_scheduled_tokens) == {"b"}
    assert scheduler.waiting.peek_request().request_id == "a"
    connector.matches["a"] = (0, False)
    out, _ = step(scheduler)
    assert "a" in out.num_scheduled_tokens
    finish(scheduler)
    assert_no_leak(scheduler)


def test_abort_during_load_frees_blocks_only_after_the_worker_confirms() -> None:
    connector = FakeConnector()
    scheduler = make(connector)
    connector.matches["a"] = (16, True)
    scheduler.add_request(make_request("a", list(range(10, 34))))
    step(scheduler)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() < pool.num_gpu_blocks - 1  # the loader may still write them
    assert scheduler.has_unfinished_requests()
    out, _ = step(scheduler)
    assert "a" in out.finished_req_ids  # the worker learns it must cancel the load
    step(scheduler, KVConnectorOutput(finished_recving={"a"}))
    assert not scheduler.has_unfinished_requests()
    assert_no_leak(scheduler)


def test_sync_load_failure_restarts_the_request() -> None:
    connector = FakeConnector()
    scheduler = make(connector)
    request = make_request("a", list(range(10, 34)), max_tokens=2)
    connector.matches["a"] = (16, False)
    scheduler.add_request(request)
    requests = dict(scheduler.requests)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 8}
    block_ids = scheduler.kv_cache_manager.get_block_ids("a")[0]
    output = fake_output(out, requests, lambda r: 7)
    output.kv_connector_output = KVConnectorOutput(invalid_block_ids={block_ids[1]})
    engine_outputs = scheduler.update_from_output(out, output)
    assert engine_outputs == {} and request.num_output_tokens == 0  # the sampled token is dropped
    assert not scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block  # nothing bad cached
    out, _ = step(scheduler)  # the connector is not asked again: a failing load must not loop
    assert "a" in out.preempted_req_ids and out.scheduled_new_reqs[0].req_id == "a"
    assert out.num_scheduled_tokens == {"a": 24}
    finish(scheduler)
    assert request.num_output_tokens == 2
    assert_no_leak(scheduler)


def test_delayed_free_and_kv_transfer_params() -> None:
    connector = FakeConnector()
    connector.delay_free = True
    scheduler = make(connector)
    scheduler.add_request(make_request("a", list(range(10, 20)), max_tokens=1))
    _, outputs = step(scheduler)
    (output,) = outputs[0].outputs
    assert output.finished and output.kv_transfer_params == {"done": "a"}
    assert scheduler.has_unfinished_requests()  # blocks still being sent
    step(scheduler, KVConnectorOutput(finished_sending={"a"}))
    assert not scheduler.has_unfinished_requests()
    assert_no_leak(scheduler)


def test_stats_carry_the_connectors_tier_stats() -> None:
    connector = FakeConnector()
    scheduler = make(connector)
    scheduler.add_request(make_request("a", list(range(10, 20)), max_tokens=1))
    step(scheduler, KVConnectorOutput(kv_connector_stats=["tiers"], kv_cache_events=["event"]))
    assert scheduler.make_stats().kv_tiers == ["tiers"]
    assert connector.take_events() == ["event"] and connector.take_events() == []


def test_no_connector_output_is_harmless() -> None:
    scheduler = make(FakeConnector())
    scheduler.add_request(make_request("a", list(range(10, 20)), max_tokens=2))
    finish(scheduler)
    assert_no_leak(scheduler)
    assert isinstance(ModelRunnerOutput([], {}, []).kv_connector_output, type(None))


def test_parked_requests_holding_blocks_cannot_starve_each_other() -> None:
    """Two loaded requests each hold half the pool and need more: nothing runs, so the scheduler
    releases the parked blocks (kept in the prefix cache) and the head runs from a local hit."""
    connector = FakeConnector()
    kv_scheduler = make_scheduler(num_blocks=11, max_model_len=40, budget=64)  # 10 usable blocks of 4
    kv_scheduler._init_kv_connector_state(connector)
    a = make_request("a", list(range(100, 139)), max_tokens=1)
    b = make_request("b", list(range(200, 239)), max_tokens=1)
    connector.matches.update(a=(20, True), b=(20, True))
    kv_scheduler.add_request(a)
    kv_scheduler.add_request(b)
    step(kv_scheduler)  # both park with 5 blocks each: the pool is full
    assert a.status == b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    connector.matches.update(a=(0, False), b=(0, False))
    step(kv_scheduler, KVConnectorOutput(finished_recving={"a", "b"}))
    out, _ = step(kv_scheduler)
    assert out.num_scheduled_tokens == {"a": 19}  # a's 20 loaded tokens came back as prefix hits
    finish(kv_scheduler)
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    assert_no_leak(kv_scheduler)
