"""Polls each server's /metrics and keeps what the fleet view, the alerts and `lmc top` show.

A ServerMonitor keeps a short history of readings (enough for the longer window) and its state:
up (answering), down (down_after_failures polls in a row failed) or starting (no answer yet).
A failed poll is a state, never an exception out of poll(): servers come and go.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from lm_console.fleet.alerts import AlertBook, AlertEvent, firing_kinds
from lm_console.fleet.config import FleetConfig, ServerSpec
from lm_console.fleet.metrics import (
    GENERATION_TOKENS, RUNNING, Figures, NotMetrics, Reading, compute_figures, counter_delta, parse_reading, restarted,
)

UP, DOWN, STARTING = "up", "down", "starting"


@dataclass(slots=True)
class ServerRow:
    """What one fleet row shows (and `lmc top --json` prints) for one server."""

    name: str
    url: str
    state: str
    kind: str | None  # "lm-console" or "vllm" (None until it answered)
    model: str | None
    figures: Figures | None
    error: str | None  # why the last poll failed
    alerts: dict[str, str]

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "url": self.url, "state": self.state, "kind": self.kind, "model": self.model,
                "figures": self.figures.as_dict() if self.figures is not None else None, "error": self.error,
                "alerts": self.alerts}


class ServerMonitor:
    """One server: its readings, its up/down state and the figures of its newest reading."""

    def __init__(self, spec: ServerSpec, config: FleetConfig, clock: Callable[[], float] = time.time) -> None:
        self.spec = spec
        self.config = config
        self.clock = clock
        self.history: deque[Reading] = deque()
        self.state = STARTING
        self.failures = 0
        self.error: str | None = None
        self.figures: Figures | None = None
        self.progress_t: float | None = None  # the last reading with a new generated token or nothing running

    @property
    def name(self) -> str:
        return self.spec.name

    async def poll(self, http: httpx.AsyncClient) -> None:
        """Read /metrics once; update the state, the history and the figures."""
        headers = {"Authorization": f"Bearer {self.spec.api_key}"} if self.spec.api_key else {}
        try:
            response = await http.get(self.spec.url + "/metrics", headers=headers)
            if response.status_code != 200:
                raise NotMetrics(f"GET /metrics answered HTTP {response.status_code}")
            reading = parse_reading(response.text, self.clock())
        except (httpx.HTTPError, NotMetrics) as error:
            self.failures += 1
            self.error = str(error) or type(error).__name__
            if self.failures >= self.config.thresholds.down_after_failures:
                self.state = DOWN
                self.figures = None  # unknown, not zero
            return
        self.failures, self.error = 0, None
        if self.state == DOWN or (self.history and restarted(reading, self.history[-1])):
            # It came back (perhaps a replacement on the same URL): its counters start a new history.
            self.history.clear()
            self.progress_t = None
        self.state = UP
        self._note_progress(reading)
        self.history.append(reading)
        # The longer window's readings (None: since the start, where the newest alone is enough).
        keep = max(self.config.rate_window_s, self.config.latency_window_s or 0.0) + 2 * self.config.poll_interval_s
        while len(self.history) > 2 and reading.t - self.history[0].t > keep:
            self.history.popleft()
        self.figures = compute_figures(list(self.history), self.config.rate_window_s, self.config.latency_window_s,
                                       self.progress_t)

    def _note_progress(self, reading: Reading) -> None:
        """Decode stalls: remember when a token was last generated (or nothing ran)."""
        previous = self.history[-1] if self.history else None
        idle = reading.gauges.get(RUNNING, 0) <= 0
        if previous is None or idle or counter_delta(reading, previous, GENERATION_TOKENS) > 0:
            self.progress_t = reading.t

    def row(self, alerts: dict[str, str]) -> ServerRow:
        newest = self.history[-1] if self.history and self.state == UP else None
        kind = None if newest is None else ("lm-console" if newest.is_ours else "vllm")
        return ServerRow(name=self.name, url=self.spec.url, state=self.state, kind=kind,
                         model=newest.model if newest is not None else None, figures=self.figures,
                         error=self.error, alerts=alerts)


class Fleet:
    """All servers of a FleetConfig, their alerts and the alert log."""

    def __init__(self, config: FleetConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.monitors = [ServerMonitor(spec, config, clock) for spec in config.servers]
        self.alerts = AlertBook()
        self.num_polls = 0
        self._http: httpx.AsyncClient | None = None

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            # Short timeouts: one slow server must not hold the whole fleet's poll.
            timeout = max(min(self.config.poll_interval_s * 2, 5.0), 1.0)
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout))
        return self._http

    async def poll(self) -> list[AlertEvent]:
        """Poll every server at once, then evaluate the alerts; the alert log's new events."""
        http = self._client()
        await asyncio.gather(*(monitor.poll(http) for monitor in self.monitors))
        self.num_polls += 1
        events: list[AlertEvent] = []
        now = self.clock()
        for monitor in self.monitors:
            firing = firing_kinds(monitor.figures, monitor.state == DOWN, self.config.thresholds)
            events += self.alerts.update(monitor.name, firing, now)
        return events

    def rows(self) -> list[ServerRow]:
        return [monitor.row(self.alerts.firing_for(monitor.name)) for monitor in self.monitors]

    def spec(self, name: str) -> ServerSpec:
        return next(m.spec for m in self.monitors if m.name == name)

    async def close(self) -> None:
        if self._http is not None:
            http, self._http = self._http, None
            await http.aclose()
