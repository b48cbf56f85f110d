"""Scheduler + EncoderScheduler: encoder inputs inside the token budget, the compute budget,
cache-limited cuts, disable_chunked_mm_input, one encoder run per image per step, freeing."""

from __future__ import annotations

import pytest

from lm_console.engine.core.kv_cache import KVCacheManager
from lm_console.engine.kv_cache_hashing import get_request_block_hasher, init_none_hash, sha256_cbor
from lm_console.engine.core.sched.encoder_scheduling import EncoderScheduler
from lm_console.engine.core.sched.scheduler import Scheduler
from lm_console.engine.errors import TooManyMultiModalItemsError
from lm_console.engine.request import MultiModalFeatureSpec, Request
from lm_console.engine.sampling_params import SamplingParams
from lm_console.engine.model_runner_output import ModelRunnerOutput

BLOCK_SIZE = 4
init_none_hash(sha256_cbor)
HASHER = get_request_block_hasher(BLOCK_SIZE, sha256_cbor)


def make_scheduler(budget: int = 32, encoder_budget: int = 16, cache_size: int = 16, max_item: int = 8,
                   disable_chunked_mm_input: bool = False) -> Scheduler:
    kv = KVCacheManager(num_blocks=128, block_size=BLOCK_SIZE, max_model_len=256, enable_caching=True)
    encoder = EncoderScheduler(encoder_budget, cache_size, max_item, budget,
                               disable_chunked_mm_input=disable_chunked_mm_input)
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256,
                     encoder_scheduler=encoder)


def mm_request(request_id: str, num_tokens: int, *images: tuple[str, int, int]) -> Request:
    """images: (identifier, offset, length); every placeholder position is an embedding."""
    features = [MultiModalFeatureSpec(identifier, offset, length) for identifier, offset, length in images]
    return Request(request_id, [5] * num_tokens, SamplingParams(max_tokens=2, ignore_eos=True), None,
                   mm_features=features, block_hasher=HASHER)


def step(scheduler: Scheduler):
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    sampled = [[7] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else []
               for r in req_ids]
    scheduler.update_from_output(output, ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled))
    return output


def test_encoder_inputs_are_scheduled_with_the_tokens_that_need_them() -> None:
    scheduler = make_scheduler(budget=8)
    scheduler.add_request(mm_request("r", 20, ("img", 10, 6)))
    first = step(scheduler)  # tokens 0..7: the image starts at 10, not needed yet
    assert first.scheduled_encoder_inputs == {}
    second = step(scheduler)  # tokens 8..15 overlap the image
    assert second.scheduled_encoder_inputs == {"r": [0]}
    third = step(scheduler)  # tokens 16..19: already encoded and cached
    assert third.scheduled_encoder_inputs == {}
    manager = scheduler.encoder_scheduler.encoder_cache_manager
    assert manager.freeable == {"img": 6}  # consumed: freeable as soon as its tokens are computed


def test_same_image_in_two_requests_is_encoded_once_per_step() -> None:
    scheduler = make_scheduler(budget=64)
    for request_id in ("a", "b"):
        scheduler.add_request(mm_request(request_id, 12, ("img", 2, 8)))
    output = step(scheduler)
    assert output.scheduled_encoder_inputs == {"a": [0]}
    assert scheduler.encoder_scheduler.encoder_cache_manager.counters.num_hits == 1


def test_compute_budget_cuts_the_step_before_the_next_image() -> None:
    # Two 8-embedding images, 8 embeddings of encoder compute per step.
    scheduler = make_scheduler(budget=64, encoder_budget=8, cache_size=16, max_item=8)
    scheduler.add_request(mm_request("r", 30, ("one", 2, 8), ("two", 14, 8)))
    first = step(scheduler)
    assert first.scheduled_encoder_inputs == {"r": [0]} and first.num_scheduled_tokens == {"r": 14}
    second = step(scheduler)
    assert second.scheduled_encoder_inputs == {"r": [1]} and second.num_scheduled_tokens == {"r": 16}


def test_full_cache_evicts_freeable_entries_and_reports_them() -> None:
    scheduler = make_scheduler(budget=64, encoder_budget=8, cache_size=8, max_item=8)
    scheduler.add_request(mm_request("a", 12, ("imgA", 2, 8)))
    while scheduler.has_unfinished_requests():
        step(scheduler)
    scheduler.add_request(mm_request("b", 12, ("imgB", 2, 8)))
    output = step(scheduler)
    assert output.scheduled_encoder_inputs == {"b": [0]}
    assert output.free_encoder_mm_hashes == ["imgA"]


def test_disable_chunked_mm_input_never_splits_an_image() -> None:
    scheduler = make_scheduler(budget=8, disable_chunked_mm_input=True)
    scheduler.add_request(mm_request("r", 20, ("img", 5, 6)))
    first = step(scheduler)
    assert first.num_scheduled_tokens == {"r": 5}  # stops before the image
    second = step(scheduler)
    assert second.num_scheduled_tokens == {"r": 8} and second.scheduled_encoder_inputs == {"r": [0]}
    # Chunked (the default) splits it instead.
    chunked = make_scheduler(budget=8)
    chunked.add_request(mm_request("r", 20, ("img", 5, 6)))
    assert step(chunked).num_scheduled_tokens == {"r": 8}


def test_unsplit_images_stay_whole_when_already_encoded_or_half_cached() -> None:
    """Bidirectional image attention (Gemma3) needs the rest of an image in one chunk, also when
    the encoder output is cached (another request) or a prefix-cache hit ends inside the image."""
    scheduler = make_scheduler(budget=8, disable_chunked_mm_input=True)
    scheduler.add_request(mm_request("a", 12, ("img", 5, 6)))
    while "a" in scheduler.requests:
        step(scheduler)
    # The same image in another prompt (no prefix hit): its encoder output is cached, yet the
    # chunk still stops before the image.
    b = Request("b", [6] * 20, SamplingParams(max_tokens=2, ignore_eos=True), None,
                mm_features=[MultiModalFeatureSpec("img", 6, 6)], block_hasher=HASHER)
    scheduler.add_request(b)
    assert step(scheduler).num_scheduled_tokens == {"b": 6}
    assert step(scheduler).num_scheduled_tokens == {"b": 8}
    encoder = scheduler.encoder_scheduler
    request = mm_request("c", 20, ("img2", 5, 6))
    assert encoder.try_schedule(request, 8, 2).num_new_tokens == 0  # 3 image tokens left: wait
    assert encoder.try_schedule(request, 8, 4).num_new_tokens == 4  # the rest fits: go


def test_validate_rejects_an_item_larger_than_the_cache() -> None:
    scheduler = make_scheduler(cache_size=8, encoder_budget=8, max_item=8)
    with pytest.raises(TooManyMultiModalItemsError, match="encoder cache"):
        scheduler.encoder_scheduler.validate(mm_request("r", 40, ("huge", 0, 30)))


def test_abort_and_preemption_release_encoder_references() -> None:
    scheduler = make_scheduler(budget=8)
    scheduler.add_request(mm_request("r", 20, ("img", 4, 8)))  # spans two steps of 8 tokens
    step(scheduler)
    manager = scheduler.encoder_scheduler.encoder_cache_manager
    assert manager.cached["img"] == {"r"}
    scheduler._preempt(scheduler.running.pop())
    assert manager.cached["img"] == set() and "img" in manager.freeable
    step(scheduler)  # rescheduled: the freeable entry is a hit, not a recompute
    assert manager.counters.num_encoder_runs == 1 and manager.counters.num_hits == 1
    from lm_console.engine.request import RequestStatus

    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert manager.cached["img"] == set() and not scheduler.requests
