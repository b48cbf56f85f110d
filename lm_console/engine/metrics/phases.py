"""RequestPhases: one request's latencies, computed once from its timestamps.

The Prometheus histograms (FinishedRequestStats), the OTLP span (engine/frontend/tracing.py) and
the console's request inspector all derive their figures from this one function, so the three
can never disagree about what "time in queue" or "prefill" means.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestPhases:
    """Seconds spent in each phase (0.0 for a phase the request never reached), vLLM's split:
    queue = scheduled - queued, prefill = first token - scheduled, decode = last token - first
    token, inference = last token - scheduled; ttft and e2e are measured from arrival."""

    time_in_queue: float
    time_to_first_token: float | None  # None: no token was produced
    prefill: float
    decode: float
    inference: float
    e2e: float | None  # None: not finished


def request_phases(arrival: float, queued: float | None, scheduled: float | None, first_token: float | None,
                   last_token: float | None, finished: float | None) -> RequestPhases:
    """The phases of a request from its timestamps (time.time() seconds; None where not reached)."""

    def between(start: float | None, end: float | None) -> float:
        return max(end - start, 0.0) if start is not None and end is not None else 0.0

    return RequestPhases(
        time_in_queue=between(queued, scheduled),
        time_to_first_token=None if first_token is None else first_token - arrival,
        prefill=between(scheduled, first_token), decode=between(first_token, last_token),
        inference=between(scheduled, last_token),
        e2e=None if finished is None else finished - arrival)
