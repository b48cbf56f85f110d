"""FakeEngineSim: blocks are never leaked, prefixes hit, a small pool preempts."""

from __future__ import annotations

from lm_console.client.fake_sim import FakeEngineSim, SimRequest
from lm_console.client.types import BLOCK_CACHED, BLOCK_IN_USE


def run_all(sim: FakeEngineSim, max_steps: int = 2000):  # noqa: ANN201
    stats_seen, events_seen, finished = [], [], []
    for step in range(max_steps):
        if not sim.has_unfinished_requests():
            break
        stats, events, chunks = sim.step(float(step))
        stats_seen.append(stats)
        events_seen += events
        finished += [c for c in chunks if c.finished]
    return stats_seen, events_seen, finished


def test_shared_prefix_hits_and_no_leaks() -> None:
    sim = FakeEngineSim(num_blocks=64, block_size=4, token_budget=32, max_num_seqs=4)
    prefix = list(range(1000, 1016))
    sim.add_request(SimRequest("a", prefix + [1, 2, 3], 5, 0.0))
    run_all(sim)
    sim.add_request(SimRequest("b", prefix + [4, 5, 6], 5, 0.0))
    stats, events, finished = run_all(sim)
    assert sum(s.prefix_hits for s in stats) == 16
    assert finished[0].num_cached_tokens == 16 and finished[0].finish_reason == "length"
    assert any(e.kind == "BlockStored" for e in events)
    states = sim.block_states()
    assert BLOCK_IN_USE not in states and states.count(BLOCK_CACHED) > 0
    assert all(c == 0 for c in sim.ref_counts) and len(sim.free_queue) == 63


def test_small_pool_preempts_and_finishes_everything() -> None:
    sim = FakeEngineSim(num_blocks=12, block_size=4, token_budget=64, max_num_seqs=8)
    for i in range(6):
        sim.add_request(SimRequest(f"r{i}", [i * 100 + j for j in range(8)], 12, 0.0))
    stats, events, finished = run_all(sim)
    assert sum(s.num_preempted_reqs for s in stats) > 0
    assert sorted(c.request_id for c in finished) == [f"r{i}" for i in range(6)]
    assert all(c == 0 for c in sim.ref_counts)
    assert any(e.kind == "BlockRemoved" for e in events)


def test_abort_and_reset() -> None:
    sim = FakeEngineSim(num_blocks=32, block_size=4)
    sim.add_request(SimRequest("x", list(range(10)), 50, 0.0))
    sim.step(0.0)
    chunk = sim.abort("x", 1.0)
    assert chunk is not None and chunk.finish_reason == "abort"
    assert sim.reset_prefix_cache(2.0)
    assert sim.block_states().count(BLOCK_CACHED) == 0
