"""Scheduler with structured outputs (torch-free): WAITING_FOR_FSM, bitmask rows only for
requests that sample, matcher advance, termination, per-request compile errors, and no bitmask
scan in a step while no structured request is in the scheduler."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace

from lm_console.engine.protocol import FinishReason
from lm_console.engine.request import RequestStatus
from lm_console.engine.sampling_params import StructuredOutputsParams
from lm_console.engine.structured_output import StructuredOutputManager
from lm_console.engine.structured_output.request import StructuredOutputRequest
from test_scheduler import assert_no_leak, make_request, make_scheduler, run_step


class FakeGrammar:
    """Allows the tokens in `allowed`; terminates after `length` accepted tokens."""

    def __init__(self, allowed: set[int], length: int) -> None:
        self.allowed, self.length, self.accepted = allowed, length, []

    @property
    def num_processed_tokens(self) -> int:
        return len(self.accepted)

    def accept_token(self, token_id: int) -> bool:
        if token_id not in self.allowed:
            return False
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


class FakeManager(StructuredOutputManager):
    """The real step logic; the 'bitmask' is the list of the step's structured request ids."""

    def __init__(self) -> None:
        backend = SimpleNamespace(allocate_bitmask=lambda num_rows: [],
                                  fill_bitmask=lambda grammars, drafts, bitmask: bitmask.extend(grammars))
        self._get_backend = lambda: backend
        self.num_structured_requests = 0  # the real manager's count, kept by the scheduler
        # What give_up() touches when a request ends while its compile runs.
        self._lock, self._slots = threading.Lock(), threading.Semaphore(1)
        self._holders, self._abandoned, self._pending, self.num_abandoned = set(), set(), set(), 0
        self.num_bitmask_scans = 0  # spy: calls of add_grammar_bitmask

    def add_grammar_bitmask(self, scheduler_output, requests) -> None:
        self.num_bitmask_scans += 1
        super().add_grammar_bitmask(scheduler_output, requests)


def structured_request(request_id: str, prompt: list[int], future: Future, **params):
    request = make_request(request_id, prompt, **params)
    request.structured_output_request = StructuredOutputRequest(StructuredOutputsParams(regex="x"), future)
    request.status = RequestStatus.WAITING_FOR_FSM
    return request


def test_waits_for_its_grammar_while_others_run_and_masks_only_sampling_steps() -> None:
    scheduler = make_scheduler(budget=8)
    scheduler.structured_output_manager = FakeManager()
    future: Future = Future()
    scheduler.add_request(structured_request("s", list(range(10, 22)), future, max_tokens=10))
    scheduler.add_request(make_request("free", [5, 6, 7]))
    out, _ = run_step(scheduler)
    assert list(out.num_scheduled_tokens) == ["free"]  # "s" still compiling: "free" goes ahead
    assert scheduler.requests["s"].status == RequestStatus.WAITING_FOR_FSM
    grammar = FakeGrammar({7}, length=3)
    future.set_result(grammar)
    out, _ = run_step(scheduler)  # "s" admitted: its first 7-token prompt chunk samples nothing
    assert out.num_scheduled_tokens["s"] == 7 and out.structured_output_request_ids == []
    out, outputs = run_step(scheduler)  # the last 5 prompt tokens: it samples, under its bitmask
    assert out.structured_output_request_ids == ["s"] and out.grammar_bitmask == [grammar]
    run_step(scheduler)
    _, outputs = run_step(scheduler)
    [final] = [o for o in outputs[0].outputs if o.request_id == "s"]
    assert grammar.accepted == [7, 7, 7] and final.finish_reason == FinishReason.STOP  # the grammar ended it
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert_no_leak(scheduler)


def test_a_grammar_that_does_not_compile_fails_only_its_request() -> None:
    scheduler = make_scheduler()
    scheduler.structured_output_manager = FakeManager()
    future: Future = Future()
    future.set_exception(RuntimeError("Regex parsing error at position 2"))
    scheduler.add_request(structured_request("bad", [1, 2, 3], future))
    scheduler.add_request(make_request("ok", [4, 5, 6]))
    out, outputs = run_step(scheduler)
    [error] = [o for o in outputs[0].outputs if o.request_id == "bad"]
    assert error.finish_reason == FinishReason.ABORT and error.error.exc_type == "InvalidStructuredOutputError"
    assert "does not compile" in error.error.message and "position 2" in error.error.message
    assert "bad" not in scheduler.requests and list(out.num_scheduled_tokens) == ["ok"]
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert_no_leak(scheduler)


def test_a_token_the_grammar_refuses_ends_the_request_with_an_error() -> None:
    scheduler = make_scheduler()
    scheduler.structured_output_manager = FakeManager()
    future: Future = Future()
    future.set_result(FakeGrammar({9}, length=5))
    scheduler.add_request(structured_request("s", [1, 2, 3], future))
    _, outputs = run_step(scheduler, next_token=lambda r: 7)
    [output] = outputs[0].outputs
    assert output.finish_reason == FinishReason.ABORT and "refused sampled token 7" in output.error.message
    assert_no_leak(scheduler)


def test_abort_while_compiling_frees_everything_and_a_late_grammar_is_ignored() -> None:
    scheduler = make_scheduler()
    scheduler.structured_output_manager = FakeManager()
    future: Future = Future()
    future.set_running_or_notify_cancel()  # its compile is under way (a queued one is cancelled instead)
    scheduler.add_request(structured_request("s", [1, 2, 3], future))
    run_step(scheduler)
    scheduler.finish_requests("s", RequestStatus.FINISHED_ABORTED)
    future.set_result(FakeGrammar({7}, length=1))  # the compile ends after the abort
    assert not scheduler.has_unfinished_requests() and "s" not in scheduler.requests
    out, outputs = run_step(scheduler)
    assert out.is_empty and not outputs
    assert_no_leak(scheduler)


def test_the_bitmask_scan_runs_only_while_a_structured_request_is_in_the_scheduler() -> None:
    scheduler = make_scheduler()
    manager = scheduler.structured_output_manager = FakeManager()
    scheduler.add_request(make_request("free", [5, 6, 7], max_tokens=3))
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens == {"free": 3} and manager.num_bitmask_scans == 0
    assert out.structured_output_request_ids == [] and out.grammar_bitmask is None
    future: Future = Future()
    grammar = FakeGrammar({7}, length=2)
    future.set_result(grammar)
    scheduler.add_request(structured_request("s", [1, 2, 3], future, max_tokens=5))
    assert manager.num_structured_requests == 1
    out, _ = run_step(scheduler)  # "s" samples under its bitmask: the scan runs
    assert manager.num_bitmask_scans == 1
    assert out.structured_output_request_ids == ["s"] and out.grammar_bitmask == [grammar]
    run_step(scheduler)  # its grammar ends it after 2 tokens; "free" ends on max_tokens too
    assert "s" not in scheduler.requests and manager.num_structured_requests == 0
    scans = manager.num_bitmask_scans
    scheduler.add_request(make_request("free2", [8, 9], max_tokens=2))
    while scheduler.has_unfinished_requests():
        out, _ = run_step(scheduler)
        assert out.grammar_bitmask is None
    assert manager.num_bitmask_scans == scans  # none since the structured request left
    # An abort while compiling and a grammar that does not compile uncount their requests too.
    scheduler.add_request(structured_request("aborted", [1, 2], Future()))
    failed: Future = Future()
    failed.set_exception(RuntimeError("Regex parsing error"))
    scheduler.add_request(structured_request("bad", [1, 2], failed))
    assert manager.num_structured_requests == 2
    scheduler.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    run_step(scheduler)
    assert not scheduler.requests and manager.num_structured_requests == 0
    assert_no_leak(scheduler)


def test_a_refusal_within_min_tokens_says_min_tokens_and_a_completion_has_no_error() -> None:
    """A refused token while min_tokens masks the stop token is the request's clash (min_tokens
    too high for the grammar), not an engine bug, and the error says so; a grammar that
    completes is a plain stop."""
    scheduler = make_scheduler()
    scheduler.structured_output_manager = FakeManager()
    refusing: Future = Future()
    refusing.set_result(FakeGrammar({9}, length=5))
    completing: Future = Future()
    completing.set_result(FakeGrammar({9}, length=1))
    scheduler.add_request(structured_request("clash", [1, 2, 3], refusing, min_tokens=3))
    scheduler.add_request(structured_request("done", [1, 2, 4], completing, min_tokens=3))
    # "clash" samples 9, 9, then 7, which its grammar refuses.
    clash_tokens = iter([9, 9, 7])
    by_id = {}
    while scheduler.has_unfinished_requests():
        _, outputs = run_step(scheduler, next_token=lambda r: next(clash_tokens) if r.request_id == "clash" else 9)
        by_id.update({output.request_id: output for output in outputs[0].outputs if output.finish_reason is not None})
    clash, done = by_id["clash"], by_id["done"]
    assert clash.finish_reason == FinishReason.ABORT
    assert "only the stop token after 2 tokens, but min_tokens=3 forbids stopping" in clash.error.message
    assert "engine bug" not in clash.error.message
    assert done.finish_reason == FinishReason.STOP and done.error is None
    assert_no_leak(scheduler)
