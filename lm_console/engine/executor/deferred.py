"""Futures for non-blocking executor calls: a worker thread, or calls deferred until awaited.

Executor.execute_model(..., non_block=True) and sample_tokens(non_block=True) return a Future so
that the engine core can schedule the next batch while this one runs (EngineCore's batch queue).
Both helpers here keep the one property the engine core relies on: the calls run one at a time,
in the order they were submitted, as on a real worker.

- WorkerThread: one thread that runs the calls (UniProcExecutor: the model runs beside the
  engine core's scheduling; torch releases the GIL inside its kernels).
- DeferredCalls: no thread; a call runs when its future (or a later one's) is awaited, after all
  the calls submitted before it. Steps are then really "in flight" between scheduling and
  awaiting, deterministically: the default for executors without a native non-blocking path
  (FakeExecutor, and tests of the batch queue).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class WorkerThread:
    """Runs submitted calls on one thread, in submission order."""

    def __init__(self, name: str = "lmc-worker") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        return self._pool.submit(fn, *args, **kwargs)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run fn on the thread after every call submitted before it, and return its result."""
        return self.submit(fn, *args, **kwargs).result()

    def shutdown(self) -> None:
        """Finish the submitted calls, then stop the thread (idempotent)."""
        self._pool.shutdown(wait=True)


class _DeferredFuture(Future):  # type: ignore[type-arg]
    """A Future whose call runs when it is awaited (with every call submitted before it)."""

    def __init__(self, owner: DeferredCalls) -> None:
        super().__init__()
        self._owner = owner

    def result(self, timeout: float | None = None) -> Any:
        self._owner.run_until(self)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._owner.run_until(self)
        return super().exception(timeout)


class DeferredCalls:
    """Calls queued in submission order; awaiting one future runs the queue up to it."""

    def __init__(self) -> None:
        self._pending: deque[tuple[_DeferredFuture, Callable[..., Any], tuple[Any, ...]]] = deque()
        self._lock = threading.RLock()
        self._in_call = False  # a deferred call is running (it may make blocking calls itself)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future = _DeferredFuture(self)
        with self._lock:
            self._pending.append((future, fn, args))
        return future

    def run_until(self, future: Future[Any] | None = None) -> None:
        """Run the queued calls in order up to `future` (all of them when None). From inside a
        deferred call it does nothing: every call before that one has run."""
        with self._lock:
            if self._in_call:
                return
            while self._pending and not (future is not None and future.done()):
                pending, fn, args = self._pending.popleft()
                self._in_call = True
                try:
                    pending.set_result(fn(*args))
                except BaseException as error:  # noqa: BLE001 - handed to whoever awaits it
                    pending.set_exception(error)
                finally:
                    self._in_call = False

    @property
    def num_pending(self) -> int:
        return len(self._pending)
