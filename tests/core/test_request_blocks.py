"""EngineCore.get_request_blocks: each unfinished request's status, preemptions, blocks and hashes."""

from __future__ import annotations

from lm_console.engine.core.engine_core import EngineCore
from lm_console.engine.executor.fake import FakeModelConfig, fake_engine_config
from lm_console.engine.protocol import EngineCoreRequest
from lm_console.engine.sampling_params import SamplingParams


def make_core(**kwargs) -> EngineCore:  # noqa: ANN003
    kwargs.setdefault("max_model_len", 128)
    return EngineCore(fake_engine_config(FakeModelConfig(vocab_size=1000, max_position_embeddings=256),
                                         block_size=4, **kwargs))


def request(request_id: str, prompt: list[int], max_tokens: int = 8) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens), eos_token_id=None,
                             arrival_time=0.0)


def test_shared_prefix_blocks_are_the_same_ids_with_the_same_hashes() -> None:
    core = make_core(num_blocks=64)
    shared = list(range(100, 116))  # four full blocks of 4
    core.add_request(request("a", shared + [1, 2, 3], max_tokens=20))
    core.step()
    core.add_request(request("b", shared + [4, 5, 6], max_tokens=20))
    core.add_request(request("queued", [7] * 9, max_tokens=20))
    core.step()
    state = core.get_request_blocks()
    rows = {r.request_id: r for r in state.requests}
    assert set(rows) == {"a", "b", "queued"}
    a, b = rows["a"].block_ids[0], rows["b"].block_ids[0]
    assert a[:4] == b[:4] and set(a[4:]).isdisjoint(b[4:])  # the shared prefix: the same physical blocks
    pool = core.kv_cache_manager.block_pool
    assert all(pool.blocks[i].ref_cnt == 2 for i in a[:4])
    num_full = rows["a"].num_computed_tokens // 4
    assert all(i in state.block_hashes for i in a[:num_full])  # full (computed) blocks are hashed
    assert not any(i in state.block_hashes for i in a[num_full:])  # the partial last one is not
    assert rows["b"].num_cached_tokens == 16 and rows["a"].status == "RUNNING"
    assert rows["a"].num_prompt_tokens == 19 and rows["a"].num_computed_tokens >= 19
    held = {i for r in state.requests for group in r.block_ids for i in group}
    assert set(state.block_hashes) <= held


def test_preemptions_are_counted_and_extra_block_hashes_answered() -> None:
    core = make_core(num_blocks=12, max_model_len=40, max_num_batched_tokens=64)
    for i in range(6):
        core.add_request(request(f"r{i}", [i * 100 + j for j in range(8)], max_tokens=12))
    seen_preempted = 0
    while core.has_unfinished_requests():
        core.step()
        state = core.get_request_blocks()
        seen_preempted = max([seen_preempted] + [r.num_preemptions for r in state.requests])
        for r in state.requests:
            # A preempted request gives its blocks back and waits with none.
            if r.status == "PREEMPTED":
                assert r.block_ids == [[]]
    assert seen_preempted > 0
    assert core.get_request_blocks().requests == []
    cached = [b.block_id for b in core.kv_cache_manager.block_pool.blocks if b.block_hash is not None]
    assert cached and set(core.get_request_blocks(cached).block_hashes) == set(cached)
