"""What an engine process (an engine core, a worker) is allowed and expected to do.

They start daemonic (multiprocessing's daemon=True): their parent terminates them when it exits,
and multiprocessing then refuses them children ("daemonic processes are not allowed to have
children"), because a killed daemon could not reap its own. Ours need no such reaping: every child
the engine starts watches a death pipe from its parent and exits with it. But whatever runs in a
core or a worker (Ray's driver, a library's process pool, a collective_rpc function, the next
executor) would meet that refusal. So each engine process drops the flag at its entry; the parent
still sees a daemon and still terminates it on exit.

A user's process may be daemonic too (a multiprocessing.Pool worker, a Celery prefork worker, a
harness's daemon process): an LLM built there starts its engine core under children_allowed(),
for the same reason: the core exits with its parent through its death pipe.

An engine process also owns everything it starts: no one else shares its worker forkserver, so
the executor may stop that server when it shuts down (multiproc.py), which a user's process
running an in-process engine core must not (an engine-core launch may share it there).
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator

_engine_process = False


def enter_engine_process() -> None:
    """Called first by an engine core's or a worker's entry point (see the module docstring)."""
    global _engine_process
    _engine_process = True
    multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]


def in_engine_process() -> bool:
    """Whether this process is an engine core or a worker (enter_engine_process ran)."""
    return _engine_process


@contextlib.contextmanager
def children_allowed() -> Iterator[None]:
    """Let this process start an engine process even when it is daemonic (restored after)."""
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    missing = object()
    daemon = config.get("daemon", missing)
    config["daemon"] = False
    try:
        yield
    finally:
        if daemon is missing:
            config.pop("daemon", None)
        else:
            config["daemon"] = daemon
