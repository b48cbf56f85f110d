"""One server's /metrics (vLLM names) as a reading, and a window of readings as a row of figures.

A reading keeps what the figures need and nothing else: the gauges (running, waiting, KV usage),
the counters (tokens, preemptions, prefix queries and hits, finished requests by reason, HTTP
5xx responses) and the cumulative buckets of three histograms (TTFT, ITL, queue time). Values are
summed over the label sets that are not needed (several engines behind one server, models).
Rates and quantiles come from the difference between the newest reading and an older one (as
Prometheus' rate() and histogram_quantile() over a window do); a counter that went down means
the server restarted, and then everything it counted is new.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
KV_USAGE, KV_USAGE_OLD = "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"  # a 0-1 fraction
PROMPT_TOKENS, GENERATION_TOKENS = "vllm:prompt_tokens_total", "vllm:generation_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"
PREFIX_QUERIES, PREFIX_HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
REQUEST_SUCCESS = "vllm:request_success_total"  # label finished_reason: stop, length, abort, error
HTTP_REQUESTS = "http_requests_total"  # vLLM's HTTP instrumentation: label status ("5xx" or "503")
TTFT = "vllm:time_to_first_token_seconds"
ITL, ITL_OLD = "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"
QUEUE_TIME = "vllm:request_queue_time_seconds"
HISTOGRAMS = (TTFT, ITL, ITL_OLD, QUEUE_TIME)
GAUGES = (RUNNING, WAITING, KV_USAGE, KV_USAGE_OLD)
COUNTERS = (PROMPT_TOKENS, GENERATION_TOKENS, PREEMPTIONS, PREFIX_QUERIES, PREFIX_HITS)
# Derived counters a reading adds (not sample names of the server).
ERRORS = "errors"  # requests finished with reason "error" plus HTTP 5xx responses
FINISHED = "finished"  # requests finished, any reason


class NotMetrics(ValueError):
    """The text is not Prometheus exposition text (or has no vLLM-named metric)."""


@dataclass(slots=True)
class Reading:
    """One parse of /metrics at time `t` (this machine's clock)."""

    t: float
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    # histogram -> [(upper bound, cumulative count)], sorted by bound, +Inf last
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    is_ours: bool = False  # an lm-console server (it also publishes lmc: metrics)
    model: str | None = None


def parse_reading(text: str, t: float) -> Reading:
    """Parse /metrics text; NotMetrics when it is not Prometheus text with vLLM's names."""
    reading = Reading(t=t)
    buckets: dict[str, dict[float, float]] = {}
    any_vllm = False
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name, labels, value = sample.name, sample.labels, float(sample.value)
                any_vllm = any_vllm or name.startswith("vllm:")
                reading.is_ours = reading.is_ours or name.startswith("lmc:")
                if reading.model is None and labels.get("model_name"):
                    reading.model = labels["model_name"]
                if name in GAUGES:
                    reading.gauges[name] = reading.gauges.get(name, 0.0) + value
                elif name in COUNTERS:
                    reading.counters[name] = reading.counters.get(name, 0.0) + value
                elif name == REQUEST_SUCCESS:
                    reading.counters[FINISHED] = reading.counters.get(FINISHED, 0.0) + value
                    if labels.get("finished_reason") == "error":
                        reading.counters[ERRORS] = reading.counters.get(ERRORS, 0.0) + value
                elif name == HTTP_REQUESTS and labels.get("status", "").startswith("5"):
                    reading.counters[ERRORS] = reading.counters.get(ERRORS, 0.0) + value
                elif name.endswith("_bucket") and name[:-len("_bucket")] in HISTOGRAMS:
                    by_bound = buckets.setdefault(name[:-len("_bucket")], {})
                    bound = float(labels["le"])
                    by_bound[bound] = by_bound.get(bound, 0.0) + value
    except (ValueError, KeyError, TypeError) as error:  # the parser's complaints about malformed text
        raise NotMetrics(f"not Prometheus text: {error}") from error
    if not any_vllm:
        raise NotMetrics("no vLLM-named metric (vllm:*) in /metrics")
    reading.buckets = {name: sorted(by_bound.items()) for name, by_bound in buckets.items()}
    if ITL not in reading.buckets and ITL_OLD in reading.buckets:  # vLLM before the ITL rename
        reading.buckets[ITL] = reading.buckets.pop(ITL_OLD)
    return reading


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (bound, count) buckets; None without observations.

    Linear interpolation inside the bucket where the rank falls; the lowest bucket starts at 0;
    a rank in the +Inf bucket answers the highest finite bound.
    """
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > lower_count:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def bucket_delta(new: Sequence[tuple[float, float]], old: Sequence[tuple[float, float]] | None
                 ) -> list[tuple[float, float]]:
    """The buckets of the observations made between two readings (all of `new` after a restart)."""
    if not old:
        return list(new)
    before = dict(old)
    delta = [(bound, count - before.get(bound, 0.0)) for bound, count in new]
    if any(count < 0 for _, count in delta):
        return list(new)
    return delta


@dataclass(slots=True)
class Figures:
    """One fleet row: the gauges now, rates over the rate window, quantiles over the latency window."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # 0-1
    prompt_tps: float = 0.0  # prompt tokens per second
    gen_tps: float = 0.0  # generated tokens per second
    ttft_p50: float | None = None  # seconds
    ttft_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    queue_p99: float | None = None
    prefix_hit_rate: float | None = None  # 0-1; None without queries in the window
    preemptions_per_s: float = 0.0
    errors_per_s: float = 0.0
    # Seconds since a generated token was last counted while requests ran (0 when none run).
    decode_stall_s: float = 0.0

    def as_dict(self) -> dict[str, float | int | None]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


def counter_delta(new: Reading, old: Reading | None, name: str) -> float:
    """What a counter counted between two readings (all of it after a restart or with no older one)."""
    value = new.counters.get(name, 0.0)
    if old is None:
        return value
    before = old.counters.get(name, 0.0)
    return value - before if value >= before else value


def restarted(new: Reading, old: Reading) -> bool:
    """Whether any counter went down between two readings: the server started over."""
    return any(new.counters.get(name, 0.0) < value for name, value in old.counters.items())


def oldest_within(history: Sequence[Reading], window_s: float | None) -> Reading | None:
    """The oldest reading not older than window_s before the newest (None: the server's start).

    With window_s None the baseline is the server's start (counters from zero): `lmc top --once`.
    """
    if window_s is None or len(history) < 2:
        return None
    newest = history[-1]
    for reading in history[:-1]:
        if newest.t - reading.t <= window_s + 1e-9:
            return reading
    return history[-2]  # polls further apart than the window: the previous one


def compute_figures(history: Sequence[Reading], rate_window_s: float | None, latency_window_s: float | None,
                    stall_since: float | None = None) -> Figures:
    """The row of figures of the newest reading in `history` (oldest first, one server, no restarts).

    Rates need two readings (0 with one); with a window of None, rates are over the whole history
    and quantiles are since the server's start. stall_since: when the decode stall began (monitor).
    """
    new = history[-1]
    gauges = new.gauges
    figures = Figures(running=int(gauges.get(RUNNING, 0)), waiting=int(gauges.get(WAITING, 0)),
                      kv_usage=float(gauges.get(KV_USAGE, gauges.get(KV_USAGE_OLD, 0.0))))
    rate_base = history[0] if rate_window_s is None and len(history) > 1 else oldest_within(history, rate_window_s)
    if rate_base is not None and new.t > rate_base.t:
        span = new.t - rate_base.t
        figures.prompt_tps = counter_delta(new, rate_base, PROMPT_TOKENS) / span
        figures.gen_tps = counter_delta(new, rate_base, GENERATION_TOKENS) / span
        figures.preemptions_per_s = counter_delta(new, rate_base, PREEMPTIONS) / span
        figures.errors_per_s = counter_delta(new, rate_base, ERRORS) / span
    base = oldest_within(history, latency_window_s)
    quantiles = {}
    for name in (TTFT, ITL, QUEUE_TIME):
        window = bucket_delta(new.buckets.get(name, []), base.buckets.get(name) if base is not None else None)
        quantiles[name] = (histogram_quantile(0.5, window), histogram_quantile(0.99, window))
    figures.ttft_p50, figures.ttft_p99 = quantiles[TTFT]
    figures.itl_p50, figures.itl_p99 = quantiles[ITL]
    figures.queue_p99 = quantiles[QUEUE_TIME][1]
    queries = counter_delta(new, base, PREFIX_QUERIES)
    figures.prefix_hit_rate = counter_delta(new, base, PREFIX_HITS) / queries if queries > 0 else None
    if stall_since is not None and figures.running > 0:
        figures.decode_stall_s = max(new.t - stall_since, 0.0)
    return figures
