"""Start-up phase marks: with LMC_STARTUP_TRACE=1, each phase of a cold start prints one line.

`lmc generate` (and anything else that builds an engine) calls `mark(phase)` as each phase of
its start ends: the CLI parsed, the engine imported, the config resolved, torch imported, the
weights loaded, the KV cache allocated, the tokenizer loaded, the first token sampled. Each mark
is one JSON line on stderr, `{"lmc_startup": phase, "t": <time.time()>, "cpu": <process CPU s>,
"pid": ...}` (an engine core in its own process marks its phases too, with its own pid and CPU),
so a parent (benchmarks/vs_llamacpp.py's cold measure) can subtract its own launch time from
each wall clock and attribute the time between marks to the phase that ended. Off (the
default), a mark costs one dictionary lookup. Torch-free: it sits at the bottom of the imports.
"""

from __future__ import annotations

import json
import os
import sys
import time

from lm_console.engine import envs

ENV_VAR = envs.LMC_STARTUP_TRACE.name
_seen: set[str] = set()


def enabled() -> bool:
    """Whether marks print (LMC_STARTUP_TRACE set to anything but "", "0")."""
    return envs.LMC_STARTUP_TRACE.get() not in ("", "0")


def mark(phase: str) -> None:
    """Print the end of `phase` (once per process: a second engine's start is not a cold start)."""
    if phase in _seen or not enabled():
        return
    _seen.add(phase)
    line = {"lmc_startup": phase, "t": time.time(), "cpu": time.process_time(), "pid": os.getpid()}
    print(json.dumps(line), file=sys.stderr, flush=True)


def parse_marks(stderr: str) -> list[tuple[str, float, float, int]]:
    """(phase, wall time.time(), process CPU s, pid) of every mark line in stderr, in order."""
    marks = []
    for line in stderr.splitlines():
        if not line.startswith('{"lmc_startup"'):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        marks.append((str(entry["lmc_startup"]), float(entry["t"]), float(entry["cpu"]), int(entry["pid"])))
    return marks


__all__ = ["ENV_VAR", "enabled", "mark", "parse_marks"]
