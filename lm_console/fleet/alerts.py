"""Alerts on a fleet's figures: thresholds (defaults, overridable in the fleet file) and the log
of when each alert fired and cleared.

An alert is (server, kind). It fires on the first evaluation where its condition holds and
clears on the first where it does not; each change is one AlertEvent in the log. A server that
does not answer fires `down` and no other alert (its figures are unknown, not zero).
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, fields

from lm_console.fleet.metrics import Figures

# The kinds, in the order the header lists them.
DOWN, KV_USAGE, PREEMPTIONS, QUEUE_TIME, ERRORS, DECODE_STALL = (
    "down", "kv_usage", "preemptions", "queue_time", "errors", "decode_stall")
KINDS = (DOWN, KV_USAGE, PREEMPTIONS, QUEUE_TIME, ERRORS, DECODE_STALL)


@dataclass(slots=True)
class Thresholds:
    """When each alert fires (the fleet file's [alerts] table; its keys are these names).

    The defaults: a KV pool this full preempts soon; a preemption a second is a storm (each one
    recomputes a request's KV); a p99 queue time of 5 s is what a user notices; any steady error
    rate is worth a look; a running batch that made no token for 10 s is stuck, not slow.
    """

    kv_usage: float = 0.95  # fraction of the KV pool in use
    preemptions_per_s: float = 1.0
    queue_time_p99_s: float = 5.0  # over the latency window
    errors_per_s: float = 0.1  # requests finished with an error, and HTTP 5xx responses
    decode_stall_s: float = 10.0  # no generated token for this long while requests run
    down_after_failures: int = 2  # polls in a row that fail before a server counts as down

    @classmethod
    def from_table(cls, table: dict[str, object], where: str) -> Thresholds:
        """Thresholds from a TOML table; ValueError naming the unknown key or bad value."""
        known = {f.name: f.type for f in fields(cls)}
        values: dict[str, float | int] = {}
        for key, value in table.items():
            if key not in known:
                raise ValueError(f"{where}: unknown alert {key!r} (known: {', '.join(known)})")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{where}: {key} must be a number >= 0, got {value!r}")
            values[key] = int(value) if key == "down_after_failures" else float(value)
        return cls(**values)  # type: ignore[arg-type]

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def firing_kinds(figures: Figures | None, down: bool, thresholds: Thresholds) -> dict[str, str]:
    """The alerts whose condition holds now: kind -> what the row and the log say about it."""
    if down or figures is None:
        return {DOWN: "not answering /metrics"} if down else {}
    firing: dict[str, str] = {}
    if figures.kv_usage >= thresholds.kv_usage:
        firing[KV_USAGE] = f"KV usage {figures.kv_usage:.0%} >= {thresholds.kv_usage:.0%}"
    if figures.preemptions_per_s >= thresholds.preemptions_per_s:
        firing[PREEMPTIONS] = f"{figures.preemptions_per_s:.2f} preemptions/s >= {thresholds.preemptions_per_s:g}"
    if figures.queue_p99 is not None and figures.queue_p99 >= thresholds.queue_time_p99_s:
        firing[QUEUE_TIME] = f"queue time p99 {figures.queue_p99:.2f} s >= {thresholds.queue_time_p99_s:g} s"
    if figures.errors_per_s >= thresholds.errors_per_s and figures.errors_per_s > 0:
        firing[ERRORS] = f"{figures.errors_per_s:.2f} errors/s >= {thresholds.errors_per_s:g}"
    if figures.running > 0 and figures.decode_stall_s >= thresholds.decode_stall_s:
        firing[DECODE_STALL] = (f"no token for {figures.decode_stall_s:.1f} s with {figures.running} running "
                                f"(>= {thresholds.decode_stall_s:g} s)")
    return firing


@dataclass(slots=True)
class AlertEvent:
    """One line of the alert log: an alert fired or cleared."""

    t: float
    server: str
    kind: str
    fired: bool  # False: cleared
    detail: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class AlertBook:
    """The alerts firing now (server -> kind -> detail since it fired) and the log of changes."""

    def __init__(self, max_log: int = 500) -> None:
        self.firing: dict[str, dict[str, tuple[float, str]]] = {}
        self.log: deque[AlertEvent] = deque(maxlen=max_log)

    def update(self, server: str, now: dict[str, str], t: float) -> list[AlertEvent]:
        """Set `server`'s firing alerts to `now`; the log's new events (fired and cleared)."""
        before = self.firing.setdefault(server, {})
        events = [AlertEvent(t, server, kind, True, detail) for kind, detail in now.items() if kind not in before]
        events += [AlertEvent(t, server, kind, False, detail) for kind, (_, detail) in before.items()
                   if kind not in now]
        # A firing alert keeps its start time; its detail follows the figures.
        self.firing[server] = {kind: (before[kind][0] if kind in before else t, detail) for kind, detail in now.items()}
        self.log.extend(events)
        return events

    def firing_for(self, server: str) -> dict[str, str]:
        return {kind: detail for kind, (_, detail) in self.firing.get(server, {}).items()}

    @property
    def num_firing(self) -> int:
        return sum(len(kinds) for kinds in self.firing.values())

    def summary(self) -> list[tuple[str, str]]:
        """(server, kind) of every firing alert, in KINDS order per server."""
        return [(server, kind) for server, kinds in self.firing.items()
                for kind in KINDS if kind in kinds]
