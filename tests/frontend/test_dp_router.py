"""DPRouter: least-loaded and prefix routing from the cores' stats and KV events (no processes)."""

from __future__ import annotations

import pytest

from lm_console.engine.frontend.dp_router import DPRouter
from lm_console.engine.kv_cache_hashing import hash_block_tokens, sha256_cbor
from lm_console.engine.metrics.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from lm_console.engine.metrics.stats import SchedulerStats
from lm_console.engine.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from lm_console.engine.sampling_params import SamplingParams

ROOTS = [b"root-0" * 4, b"root-1" * 4, b"root-2" * 4]


def _request(request_id: str, tokens: list[int], cache_salt: str | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=tokens, sampling_params=SamplingParams(),
                             eos_token_id=None, arrival_time=0.0, cache_salt=cache_salt)


def _hashes(root: bytes, tokens: list[int], block_size: int = 4, salt: str | None = None) -> list[bytes]:
    out, parent = [], root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = (salt,) if salt and start == 0 else None
        parent = hash_block_tokens(sha256_cbor, parent, tokens[start:start + block_size], extra)
        out.append(parent)
    return out


def _stats(router: DPRouter, core: int, waiting: int, running: int, usage: float = 0.0) -> None:
    router.observe(core, EngineCoreOutputs(scheduler_stats=SchedulerStats(
        num_waiting_reqs=waiting, num_running_reqs=running, kv_cache_usage=usage)))


def _stored(router: DPRouter, core: int, hashes: list[bytes]) -> None:
    event = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=4)
    router.observe(core, EngineCoreOutputs(kv_events=KVEventBatch(ts=0.0, events=[event])))


def _router(policy: str, num_cores: int = 3) -> DPRouter:
    router = DPRouter(num_cores, policy, block_size=4)
    for core in range(num_cores):
        router.set_none_hash(core, ROOTS[core])
    return router


def test_a_batch_spreads_evenly_over_idle_cores() -> None:
    router = _router("least_loaded")
    by_core = router.assign([_request(str(i), [1, 2, 3]) for i in range(7)])
    assert sorted(len(requests) for requests in by_core.values()) == [2, 2, 3]
    assert {router.owner_of(str(i)) for i in range(7)} == {0, 1, 2}


def test_the_least_loaded_core_wins_and_waiting_counts_more_than_running() -> None:
    router = _router("least_loaded")
    _stats(router, 0, waiting=0, running=3)
    _stats(router, 1, waiting=1, running=0)  # one queued request weighs 4 running ones
    _stats(router, 2, waiting=0, running=5)
    assert list(router.assign([_request("a", [1])])) == [0]
    # equal counts: the lower KV usage wins
    router = _router("least_loaded", 2)
    _stats(router, 0, 0, 0, usage=0.5)
    _stats(router, 1, 0, 0, usage=0.1)
    assert list(router.assign([_request("b", [1])])) == [1]


def test_requests_sent_and_not_finished_count_until_their_finish_is_seen() -> None:
    router = _router("least_loaded", 2)
    router.assign([_request("a", [1]), _request("b", [1])])
    assert {router.owner_of("a"), router.owner_of("b")} == {0, 1}
    core_a = router.owner_of("a")
    router.observe(core_a, EngineCoreOutputs(outputs=[
        EngineCoreOutput(request_id="a", new_token_ids=[5], finish_reason=FinishReason.LENGTH)]))
    assert router.owner_of("a") is None
    assert list(router.assign([_request("c", [1])])) == [core_a]  # the core that finished is free again
    # an abort goes to the owner and is forgotten; an unknown id is nothing to send
    assert router.release(["c", "nope"]) == {core_a: ["c"]}
    assert router.snapshot()[core_a]["in_flight"] == 0


def test_prefix_routing_prefers_the_core_holding_the_longest_prefix() -> None:
    router = _router("prefix")
    tokens = list(range(100, 116))  # 4 full blocks
    _stored(router, 0, _hashes(ROOTS[0], tokens)[:1])
    _stored(router, 2, _hashes(ROOTS[2], tokens)[:3])
    _stored(router, 1, _hashes(ROOTS[0], tokens))  # core 0's chain: worthless under core 1's root
    _stats(router, 2, waiting=0, running=6)  # busier, but holds 3 blocks
    assert list(router.assign([_request("a", tokens + [7])])) == [2]
    assert router.matched_blocks(router.cores[2], _request("x", tokens)) == 3
    # the salt enters the first block's hash: a salted request matches nothing here
    assert router.matched_blocks(router.cores[2], _request("y", tokens, cache_salt="s")) == 0
    salted = _hashes(ROOTS[1], tokens, salt="s")
    _stored(router, 1, salted)
    assert router.matched_blocks(router.cores[1], _request("z", tokens, cache_salt="s")) == 4


def test_prefix_routing_follows_removals_and_clears_and_avoids_queues() -> None:
    router = _router("prefix", 2)
    tokens = list(range(8))
    hashes = _hashes(ROOTS[1], tokens)
    _stored(router, 1, hashes)
    assert router.matched_blocks(router.cores[1], _request("a", tokens)) == 2
    router.observe(1, EngineCoreOutputs(kv_events=KVEventBatch(0.0, [BlockRemoved(block_hashes=[hashes[1]])])))
    assert router.matched_blocks(router.cores[1], _request("a", tokens)) == 1
    # an offload tier's blocks are not the core's device cache
    router.observe(1, EngineCoreOutputs(kv_events=KVEventBatch(0.0, [
        BlockStored(block_hashes=[hashes[1]], parent_block_hash=None, token_ids=[], block_size=4, medium="CPU")])))
    assert router.matched_blocks(router.cores[1], _request("a", tokens)) == 1
    _stats(router, 1, waiting=2, running=8)  # the holder has a queue and core 0 none: least loaded wins
    assert list(router.assign([_request("b", tokens)])) == [0]
    _stats(router, 1, waiting=0, running=8)
    assert list(router.assign([_request("c", tokens)])) == [1]
    router.observe(1, EngineCoreOutputs(kv_events=KVEventBatch(0.0, [AllBlocksCleared()])))
    assert router.matched_blocks(router.cores[1], _request("d", tokens)) == 0


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="round_robin"):
        DPRouter(2, "round_robin")
