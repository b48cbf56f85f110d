"""Non-blocking executor calls: in submission order, errors handed to whoever awaits them."""

from __future__ import annotations

import threading

import pytest

from lm_console.engine.executor.deferred import DeferredCalls, WorkerThread


def test_deferred_calls_run_in_order_when_awaited() -> None:
    calls = DeferredCalls()
    ran: list[int] = []
    futures = [calls.submit(ran.append, i) for i in range(4)]
    assert ran == [] and calls.num_pending == 4 and not futures[0].done()
    futures[1].result()  # runs 0 then 1, not 2 or 3
    assert ran == [0, 1] and calls.num_pending == 2
    futures[0].result()  # already done: runs nothing more
    assert ran == [0, 1]
    calls.run_until(None)
    assert ran == [0, 1, 2, 3] and all(f.done() for f in futures)


def test_a_deferred_error_goes_to_its_future_and_later_calls_still_run() -> None:
    calls = DeferredCalls()
    ran: list[str] = []

    def boom() -> None:
        raise RuntimeError("worker failed")

    bad = calls.submit(boom)
    good = calls.submit(ran.append, "after")
    assert good.result() is None and ran == ["after"]
    with pytest.raises(RuntimeError, match="worker failed"):
        bad.result()
    assert isinstance(bad.exception(), RuntimeError)


def test_a_deferred_call_may_make_blocking_calls_of_its_own() -> None:
    calls = DeferredCalls()
    ran: list[str] = []

    def outer() -> None:
        calls.run_until(None)  # from inside a deferred call: a no-op (not a deadlock, nor "later" first)
        ran.append("outer")

    first = calls.submit(outer)
    later = calls.submit(ran.append, "later")
    first.result()
    assert ran == ["outer"] and not later.done()
    later.result()
    assert ran == ["outer", "later"]


def test_worker_thread_runs_calls_in_order_on_one_thread() -> None:
    worker = WorkerThread()
    seen: list[tuple[int, str]] = []
    futures = [worker.submit(lambda i=i: seen.append((i, threading.current_thread().name))) for i in range(5)]
    for future in futures:
        future.result()
    assert [i for i, _ in seen] == list(range(5))
    assert len({name for _, name in seen}) == 1 and seen[0][1].startswith("lmc-worker")
    assert worker.call(lambda: threading.current_thread().name) == seen[0][1]
    worker.shutdown()
    worker.shutdown()  # idempotent
