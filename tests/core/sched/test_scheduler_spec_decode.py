"""Scheduler with speculative decoding (torch-free): which requests get drafts and how many
(num_speculative_tokens, the budget, max_tokens, max_model_len, penalties, a grammar), the
rollback of the rejected drafts' KV, and the acceptance counters."""

from __future__ import annotations

from concurrent.futures import Future

from lm_console.engine.config.speculative import SpeculativeConfig
from lm_console.engine.core.kv_cache import KVCacheManager
from lm_console.engine.core.sched.scheduler import Scheduler
from lm_console.engine.model_runner_output import ModelRunnerOutput
from test_scheduler import BLOCK_SIZE, assert_no_leak, make_request
from test_scheduler_structured import FakeGrammar, FakeManager, structured_request

BONUS = 7  # the target's own token after the accepted drafts


class FakeProposer:
    """Proposes drafts[:num_drafts] (default 100, 101, ...); records what it was asked."""

    def __init__(self, drafts: list[int] | None = None) -> None:
        self.drafts = drafts or list(range(100, 116))
        self.calls: list[tuple[str, int]] = []

    def propose(self, request_id: str, token_ids: list[int], num_drafts: int) -> list[int]:
        self.calls.append((request_id, num_drafts))
        return self.drafts[:num_drafts]

    def forget(self, request_id: str) -> None:
        pass


def make_spec_scheduler(budget: int = 32, max_model_len: int = 64, num_spec: int = 3,
                        drafts: list[int] | None = None,
                        config: SpeculativeConfig | None = None) -> tuple[Scheduler, FakeProposer]:
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE, max_model_len=max_model_len, enable_caching=True)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=max_model_len,
                          speculative_config=config or SpeculativeConfig(num_speculative_tokens=num_spec))
    proposer = FakeProposer(drafts)
    scheduler.proposer = proposer
    return scheduler, proposer


def spec_step(scheduler: Scheduler, accepted: dict[str, int] | None = None):  # noqa: ANN201
    """One step; a request with drafts gets its first accepted[req] drafts (default 0) and the
    bonus token, one without gets the bonus token once its prompt is computed."""
    requests = dict(scheduler.requests)
    out = scheduler.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = requests[req_id]
        drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append(drafts[:(accepted or {}).get(req_id, 0)] + [BONUS] if done else [])
    runner_output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                      sampled_token_ids=sampled)
    return out, scheduler.update_from_output(out, runner_output)


def test_drafts_are_verified_and_the_rejected_ones_recomputed() -> None:
    scheduler, proposer = make_spec_scheduler()
    scheduler.add_request(make_request("a", list(range(10, 22)), max_tokens=10))
    out, _ = spec_step(scheduler)  # the prefill: no drafts
    assert out.num_scheduled_tokens == {"a": 12} and not out.scheduled_spec_decode_tokens and not proposer.calls
    out, outputs = spec_step(scheduler, {"a": 1})
    assert proposer.calls == [("a", 3)]
    assert out.num_scheduled_tokens == {"a": 4} and out.scheduled_spec_decode_tokens == {"a": [100, 101, 102]}
    assert outputs[0].outputs[0].new_token_ids == [100, BONUS]
    request = scheduler.requests["a"]
    # Computed: every token but the bonus one (the rejected drafts' KV is recomputed).
    assert request.num_computed_tokens == request.num_tokens - 1 == 14
    stats = scheduler.make_stats().spec_decoding
    assert stats is not None
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]
    out, outputs = spec_step(scheduler, {"a": 3})  # the next step drafts again, from the bonus token
    assert out.num_scheduled_tokens == {"a": 4} and out.scheduled_spec_decode_tokens == {"a": [100, 101, 102]}
    assert outputs[0].outputs[0].new_token_ids == [100, 101, 102, BONUS]
    stats = scheduler.make_stats().spec_decoding
    assert stats is not None and (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 4)
    assert stats.num_accepted_tokens_per_pos == [2, 1, 1]
    while scheduler.has_unfinished_requests():
        spec_step(scheduler)
    assert_no_leak(scheduler)


def test_the_budget_cuts_the_drafts() -> None:
    """Budget 3: the real token and 2 of the 3 drafts; then "b" left with a budget of one token
    gets no drafts at all."""
    scheduler, _ = make_spec_scheduler(budget=3)
    scheduler.add_request(make_request("a", [5, 6, 7], max_tokens=10))
    spec_step(scheduler)
    out, _ = spec_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 3} and out.scheduled_spec_decode_tokens == {"a": [100, 101]}
    scheduler, _ = make_spec_scheduler(budget=5)
    scheduler.add_request(make_request("a", [5, 6], max_tokens=10))
    scheduler.add_request(make_request("b", [8, 9], max_tokens=10))
    spec_step(scheduler)
    out, _ = spec_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 4, "b": 1}
    assert out.scheduled_spec_decode_tokens == {"a": [100, 101, 102]}


def test_drafts_never_run_past_max_tokens_or_max_model_len() -> None:
    scheduler, proposer = make_spec_scheduler()
    scheduler.add_request(make_request("a", [5, 6, 7], max_tokens=3))
    spec_step(scheduler)
    out, _ = spec_step(scheduler)  # 1 output token: 2 more at most, the last the target's own
    assert proposer.calls == [("a", 1)] and out.scheduled_spec_decode_tokens == {"a": [100]}
    scheduler, proposer = make_spec_scheduler(max_model_len=16)
    scheduler.add_request(make_request("b", list(range(10, 23)), max_tokens=10))  # 13 prompt tokens
    spec_step(scheduler)
    out, _ = spec_step(scheduler)  # 14 tokens: 2 more fit in max_model_len
    assert proposer.calls == [("b", 2)] and out.scheduled_spec_decode_tokens == {"b": [100, 101]}


def test_penalties_get_no_drafts() -> None:
    """A penalty depends on every earlier sample, which the verification cannot replay."""
    scheduler, proposer = make_spec_scheduler()
    scheduler.add_request(make_request("plain", [5, 6, 7], max_tokens=10))
    scheduler.add_request(make_request("penalty", [5, 6, 8], max_tokens=10, frequency_penalty=0.5))
    spec_step(scheduler)
    out, _ = spec_step(scheduler)
    assert proposer.calls == [("plain", 3)]
    assert out.scheduled_spec_decode_tokens == {"plain": [100, 101, 102]}


class DraftGrammar(FakeGrammar):
    def valid_prefix(self, token_ids: list[int]) -> list[int]:
        n = 0
        while n < len(token_ids) and token_ids[n] in self.allowed:
            n += 1
        return token_ids[:n]


def test_a_structured_request_s_drafts_are_cut_at_the_first_token_its_grammar_refuses() -> None:
    scheduler, proposer = make_spec_scheduler(drafts=[BONUS, BONUS, 9])
    scheduler.structured_output_manager = FakeManager()
    future: Future = Future()
    future.set_result(DraftGrammar({BONUS}, length=10))
    scheduler.add_request(structured_request("s", [5, 6, 7], future, max_tokens=10))
    spec_step(scheduler)
    out, _ = spec_step(scheduler)
    assert proposer.calls == [("s", 3)] and out.scheduled_spec_decode_tokens == {"s": [BONUS, BONUS]}
    assert out.num_scheduled_tokens == {"s": 3}


def test_no_drafts_from_the_batch_size_limit_on() -> None:
    """disable_by_batch_size: drafts while fewer requests run, none once that many do, and again
    when one finishes; "auto" resolved for the CPU is such a limit, for a GPU none."""
    cpu = SpeculativeConfig(num_speculative_tokens=3).for_device("cpu")
    assert cpu.disable_by_batch_size == 96 // 4 == cpu.batch_limit
    assert SpeculativeConfig(num_speculative_tokens=4).for_device("cpu").batch_limit == 19
    assert SpeculativeConfig(num_speculative_tokens=16).for_device("cpu").batch_limit == 5
    assert SpeculativeConfig().for_device("cuda").batch_limit is None
    assert SpeculativeConfig(disable_by_batch_size=None).for_device("cpu").batch_limit is None
    assert SpeculativeConfig(disable_by_batch_size=7).for_device("cuda").batch_limit == 7
    assert SpeculativeConfig().batch_limit is None  # unresolved "auto": no limit

    scheduler, proposer = make_spec_scheduler(budget=64, config=SpeculativeConfig(num_speculative_tokens=3,
                                                                                   disable_by_batch_size=3))
    scheduler.add_request(make_request("a", list(range(10, 14)), max_tokens=10))
    scheduler.add_request(make_request("b", list(range(20, 24)), max_tokens=10))
    spec_step(scheduler)  # prefills
    out, _ = spec_step(scheduler)
    assert set(out.scheduled_spec_decode_tokens) == {"a", "b"}, "2 running < 3: drafts"
    scheduler.add_request(make_request("c", list(range(30, 34)), max_tokens=2))
    spec_step(scheduler)  # c's prefill beside a and b's decodes: 3 running
    proposer.calls.clear()
    out, _ = spec_step(scheduler)
    assert not out.scheduled_spec_decode_tokens and not proposer.calls, "3 running: no drafts, the proposer not asked"
    assert "c" not in scheduler.requests, "c finished (max_tokens 2)"
    out, _ = spec_step(scheduler)
    assert set(out.scheduled_spec_decode_tokens) == {"a", "b"}, "back to 2 running: drafts again"
