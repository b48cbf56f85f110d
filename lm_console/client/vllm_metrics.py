"""A vLLM-compatible server's `/metrics` (Prometheus text, vLLM v1 names) as the engine's SchedulerStats.

Each poll becomes a StatsSnapshot (a SchedulerStats that is not one engine step). Gauges are read
as they are; counters (`*_total`) become deltas between two polls, so a snapshot carries what
happened since the previous one, as a per-step SchedulerStats does. Values are
summed over label sets (several engines behind one server). Parsing uses prometheus-client's
own parser.

The console's own figures (requests done, TTFT / TPOT / ITL, hit rate) count what the console
sent; a server serves others too, so each snapshot also carries the server's cumulative figures
(ServerFigures): requests finished by reason, the latency quantiles of its histograms as
Prometheus' histogram_quantile() computes them over everything observed since it started, and its
prefix-cache counters. Names moved between vLLM releases; both are read:

    TTFT   vllm:time_to_first_token_seconds
    TPOT   vllm:request_time_per_output_token_seconds (per request; newer releases only)
    ITL    vllm:inter_token_latency_seconds, before that vllm:time_per_output_token_seconds
    prefix vllm:prefix_cache_{queries,hits}_total, before that vllm:gpu_prefix_cache_{queries,hits}_total
    usage  vllm:kv_cache_usage_perc, before that vllm:gpu_cache_usage_perc
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from lm_console.engine.metrics.stats import PrefixCacheStatsSnapshot
from lm_console.client.types import ServerFigures, StatsSnapshot
from lm_console.fleet.metrics import histogram_quantile

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
KV_USAGE, KV_USAGE_OLD = "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"  # a 0-1 fraction
PREFIX_QUERIES, PREFIX_HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
PREFIX_QUERIES_OLD, PREFIX_HITS_OLD = "vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total"
TTFT = "vllm:time_to_first_token_seconds"
TPOT = "vllm:request_time_per_output_token_seconds"
ITL, ITL_OLD = "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"
HISTOGRAMS = (TTFT, TPOT, ITL, ITL_OLD)
FAILED_REASONS = ("abort", "error")  # request_success_total's finished_reason values that did not succeed
PREEMPTIONS = "vllm:num_preemptions_total"
PROMPT_TOKENS, GENERATION_TOKENS = "vllm:prompt_tokens_total", "vllm:generation_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"
CACHE_CONFIG = "vllm:cache_config_info"
COUNTERS = (PREFIX_QUERIES, PREFIX_HITS, PREEMPTIONS, PROMPT_TOKENS, GENERATION_TOKENS, REQUEST_SUCCESS)
RENAMED = {PREFIX_QUERIES_OLD: PREFIX_QUERIES, PREFIX_HITS_OLD: PREFIX_HITS}


@dataclass(slots=True)
class MetricsSnapshot:
    """One parse of /metrics: summed sample values by sample name, and cache_config_info's labels."""

    values: dict[str, float] = field(default_factory=dict)
    cache_config: dict[str, str] = field(default_factory=dict)
    model_names: list[str] = field(default_factory=list)
    # histogram -> [(upper bound, cumulative count)] sorted by bound (+Inf last), summed over label sets
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    finished_by_reason: dict[str, float] = field(default_factory=dict)  # request_success_total

    def get(self, name: str, default: float | None = None) -> float | None:
        return self.values.get(name, default)

    @property
    def is_vllm(self) -> bool:
        """Whether any vLLM-named metric is present."""
        return any(name.startswith("vllm:") for name in self.values)


def parse_metrics(text: str) -> MetricsSnapshot:
    """Parse Prometheus text; ValueError when it is not Prometheus text at all."""
    snapshot = MetricsSnapshot()
    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            value = float(sample.value)
            snapshot.values[name] = snapshot.values.get(name, 0.0) + value
            model = sample.labels.get("model_name")
            if model and model not in snapshot.model_names:
                snapshot.model_names.append(model)
            if name == CACHE_CONFIG and not snapshot.cache_config:
                snapshot.cache_config = dict(sample.labels)
            elif name == REQUEST_SUCCESS:
                reason = sample.labels.get("finished_reason", "?")
                snapshot.finished_by_reason[reason] = snapshot.finished_by_reason.get(reason, 0.0) + value
            elif name.endswith("_bucket") and name[: -len("_bucket")] in HISTOGRAMS and "le" in sample.labels:
                by_bound = buckets.setdefault(name[: -len("_bucket")], {})
                bound = float(sample.labels["le"])
                by_bound[bound] = by_bound.get(bound, 0.0) + value
    for old, new in RENAMED.items():  # an older release's name counts as the current one
        if old in snapshot.values and new not in snapshot.values:
            snapshot.values[new] = snapshot.values[old]
    if ITL not in buckets and ITL_OLD in buckets:
        buckets[ITL] = buckets.pop(ITL_OLD)
    snapshot.buckets = {name: sorted(by_bound.items()) for name, by_bound in buckets.items()}
    return snapshot


def server_figures(snapshot: MetricsSnapshot) -> ServerFigures:
    """The server's cumulative figures at this poll (see the module docstring)."""
    figures = ServerFigures(
        num_finished=int(sum(v for reason, v in snapshot.finished_by_reason.items() if reason not in FAILED_REASONS)),
        num_failed=int(sum(v for reason, v in snapshot.finished_by_reason.items() if reason in FAILED_REASONS)),
        prefix_queries=int(snapshot.values.get(PREFIX_QUERIES, 0.0)),
        prefix_hits=int(snapshot.values.get(PREFIX_HITS, 0.0)),
        missing=[name for name in (TTFT, TPOT, ITL) if name not in snapshot.buckets],
    )
    for prefix, name in (("ttft", TTFT), ("tpot", TPOT), ("itl", ITL)):
        buckets = snapshot.buckets.get(name)
        if buckets:
            setattr(figures, f"{prefix}_p50", histogram_quantile(0.50, buckets))
            setattr(figures, f"{prefix}_p95", histogram_quantile(0.95, buckets))
    return figures


class MetricsSampler:
    """Turns successive /metrics parses into StatsSnapshots (gauges now, counters as deltas)."""

    def __init__(self) -> None:
        self.previous: dict[str, float] | None = None
        self.num_total_blocks = 0

    def sample(self, snapshot: MetricsSnapshot, now: float | None = None) -> StatsSnapshot:
        """The StatsSnapshot of this poll; the first poll only sets the counters' baseline."""
        values = snapshot.values
        deltas = {name: self._delta(name, values.get(name)) for name in COUNTERS}
        self.previous = {name: values[name] for name in COUNTERS if name in values}
        usage = snapshot.get(KV_USAGE, snapshot.get(KV_USAGE_OLD, 0.0)) or 0.0
        total = self.num_total_blocks or _int(snapshot.cache_config.get("num_gpu_blocks"))
        self.num_total_blocks = total
        return StatsSnapshot(
            timestamp=time.time() if now is None else now,
            num_running_reqs=int(values.get(RUNNING, 0)), num_waiting_reqs=int(values.get(WAITING, 0)),
            num_preempted_reqs=deltas[PREEMPTIONS], num_preemptions_total=int(values.get(PREEMPTIONS, 0)),
            kv_cache_usage=float(usage), num_total_blocks=total,
            num_free_blocks=round(total * (1.0 - float(usage))) if total else 0,
            prefix_cache=PrefixCacheStatsSnapshot(requests=deltas[REQUEST_SUCCESS], queries=deltas[PREFIX_QUERIES],
                                                  hits=deltas[PREFIX_HITS]),
            num_prompt_tokens=deltas[PROMPT_TOKENS], num_generation_tokens=deltas[GENERATION_TOKENS],
            server=server_figures(snapshot),
        )

    def _delta(self, name: str, value: float | None) -> int:
        if value is None or self.previous is None:
            return 0
        before = self.previous.get(name, 0.0)
        # A counter that went down means the server restarted: everything counted is new.
        return int(value - before) if value >= before else int(value)


def _int(text: str | None) -> int:
    try:
        return int(float(text)) if text else 0
    except ValueError:
        return 0
