"""The Scheduler's optional features are composed objects with do-nothing defaults: no KV
connector (NoKVConnector), no encoder (NoEncoderScheduler); the KV connector object keeps its own
state and works on what it is handed, apart from the Scheduler."""

from __future__ import annotations

import pytest

from lm_console.engine.core.kv_cache import KVCacheManager
from lm_console.engine.core.sched.encoder_scheduling import NoEncoderScheduler
from lm_console.engine.core.sched.kv_connector_scheduling import KVConnectorScheduling, NoKVConnector
from lm_console.engine.distributed.kv_transfer.output import KVConnectorOutput
from lm_console.engine.request import RequestStatus

from test_scheduler import BLOCK_SIZE, assert_no_leak, make_request, make_scheduler, run_step
from test_scheduler_kv_connector import FakeConnector


def test_a_text_model_without_connector_gets_the_do_nothing_defaults() -> None:
    scheduler = make_scheduler()
    assert isinstance(scheduler.kv_transfer, NoKVConnector)
    assert isinstance(scheduler.encoder_scheduler, NoEncoderScheduler)
    scheduler.add_request(make_request("a", list(range(10, 20)), max_tokens=2))
    out, _ = run_step(scheduler)
    assert out.kv_connector_metadata is None and out.scheduled_encoder_inputs == {}
    stats = scheduler.make_stats()
    assert stats.encoder_cache is None and stats.kv_tiers is None
    run_step(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert_no_leak(scheduler)
    with pytest.raises(AssertionError):  # nothing is ever held for a transfer without a connector
        NoKVConnector().delay_free(make_request("b", [1]))


def test_kv_connector_scheduling_parks_loads_and_releases_them_on_its_own_state() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, max_model_len=64, enable_caching=True)
    connector = FakeConnector()
    kv_transfer = KVConnectorScheduling(connector, kv)
    request = make_request("a", list(range(10, 26)))
    connector.matches["a"] = (8, True)
    assert kv_transfer.get_num_new_matched_tokens(request, 0) == (8, True)
    assert kv.allocate_slots(request, 0, num_external_computed_tokens=8, delay_cache_blocks=True) is not None
    assert kv_transfer.update_state_after_alloc(request, 0, 8, load_async=True)  # parked
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not kv_transfer.update_waiting_for_remote_kv(request)  # nothing arrived yet
    assert kv_transfer.update_from_output(KVConnectorOutput(finished_recving={"a"})) == set()
    assert kv_transfer.update_waiting_for_remote_kv(request)
    assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 8
    assert kv_transfer.holds_loaded_blocks(request)
    assert kv_transfer.unpark_ready_requests([request])  # nothing runs: give the blocks back
    assert not kv_transfer.holds_loaded_blocks(request) and request.num_computed_tokens == 0
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_gpu_blocks - 1
