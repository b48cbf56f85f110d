"""The benchmark history: each run's JSON gets the machine's fingerprint and is appended to one file.

    from _record import record             # benchmarks/ is on sys.path when a script there runs
    record("perf_smoke", result, save_path)

Every benchmark in this folder that reports figures calls `record`: the result is stamped with the
date, the fingerprint (lm_console/bench/fingerprint.py: CPU model, ISA flags, usable CPUs, memory,
torch, commit, load average) and its id, written to `save_path` when given, and appended as one
line to the history (LMC_BENCH_HISTORY, default benchmarks/history.jsonl), so that a figure can be
compared with the same benchmark's earlier runs on the same kind of machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lm_console.bench.fingerprint import stamp
from lm_console.engine import envs

HISTORY = Path(__file__).resolve().parent / "history.jsonl"


def history_path() -> Path | None:
    """Where runs are appended (None when LMC_BENCH_HISTORY turns the history off)."""
    if envs.LMC_BENCH_HISTORY.is_set():
        return None if envs.LMC_BENCH_HISTORY.is_off() else Path(envs.LMC_BENCH_HISTORY.get())
    return HISTORY


def record(benchmark: str, result: dict[str, Any], save_path: str | Path | None = None) -> dict[str, Any]:
    """`result` stamped (date, fingerprint, fingerprint_id, benchmark name), saved to `save_path`
    when given, and appended to the history; returns the stamped record."""
    stamped = stamp({"benchmark": benchmark, **result})
    if save_path:
        Path(save_path).write_text(json.dumps(stamped, indent=1) + "\n")
    history = history_path()
    if history is not None:
        history.parent.mkdir(parents=True, exist_ok=True)
        with history.open("a") as f:
            f.write(json.dumps(stamped, separators=(",", ":")) + "\n")
    return stamped


def runs(benchmark: str | None = None, fingerprint_id: str | None = None,
         history: Path | None = None) -> list[dict[str, Any]]:
    """The recorded runs, oldest first, of one benchmark and/or one machine (None: all)."""
    path = history or history_path()
    if path is None or not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)
        if benchmark is not None and entry.get("benchmark") != benchmark:
            continue
        if fingerprint_id is not None and entry.get("fingerprint_id") != fingerprint_id:
            continue
        found.append(entry)
    return found
