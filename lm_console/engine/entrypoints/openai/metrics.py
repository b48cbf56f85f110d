"""GET /metrics: vLLM v1's Prometheus metrics (names, types, labels, buckets) and lmc: extras.

PrometheusStatLogger is a StatLoggerBase that AsyncLLM feeds with every batch of outputs: the
engine core's SchedulerStats (gauges, prefix-cache and preemption counters) and the frontend's
IterationStats (token counters, TTFT / ITL, per-request histograms). Each app has its own
CollectorRegistry, so several servers can live in one process (tests). At scrape time the
gauges are refreshed from the core (get_stats), because the stream goes quiet when the engine
idles and an aborted request would otherwise leave a stale "running" count.

Labels: model_name (the first served name) and engine ("0"), plus finished_reason on
vllm:request_success. Our extras (encoder cache, KV offload tiers, block counts) are under lmc:.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lm_console.engine.metrics.loggers import StatLoggerBase
from lm_console.engine.metrics.stats import (
    KV_BLOCK_RESIDENCY_BUCKETS,
    IterationStats,
    SchedulerStats,
    SpecDecodingStats,
)

if TYPE_CHECKING:
    from lm_console.engine.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort")
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


REQUEST_PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]  # vLLM's


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return buckets
            buckets.append(value)
        scale *= 10


class PrometheusStatLogger(StatLoggerBase):
    """vLLM's metric set in one registry, fed by AsyncLLM's stat-logger calls."""

    interval_s = 3600.0  # log() does nothing: Prometheus pulls

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int,
                 cache_info: dict[str, str], engine_index: int = 0, kv_cache_metrics: bool = False) -> None:
        self.registry = registry
        self.labels = {"model_name": model_name, "engine": str(engine_index)}
        self.cache_info = cache_info
        names = ["model_name", "engine"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=registry).labels(**self.labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=registry).labels(**self.labels)

        def histogram(name: str, doc: str, buckets: list[float] | list[int]) -> Any:
            return Histogram(name, doc, names, buckets=buckets, registry=registry).labels(**self.labels)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          names + ["finished_reason"], registry=registry)
        self.success = {reason: success.labels(finished_reason=reason, **self.labels) for reason in FINISH_REASONS}
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.request_params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                          REQUEST_PARAMS_N_BUCKETS)
        self.request_params_max_tokens = histogram("vllm:request_params_max_tokens",
                                                   "Histogram of the max_tokens request parameter.", token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.cache_config_info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                       sorted([*cache_info, "engine"]), registry=registry)
        self.kv_block_residency: tuple[Any, Any, Any] | None = None
        if kv_cache_metrics:  # vLLM's sampled block residency histograms (--kv-cache-metrics)
            self.kv_block_residency = (
                histogram("vllm:kv_block_lifetime_seconds", "Histogram of KV cache block lifetime from allocation "
                          "to eviction. Sampled metrics (controlled by --kv-cache-metrics-sample).",
                          KV_BLOCK_RESIDENCY_BUCKETS),
                histogram("vllm:kv_block_idle_before_evict_seconds", "Histogram of idle time before KV cache block "
                          "eviction. Sampled metrics (controlled by --kv-cache-metrics-sample).",
                          KV_BLOCK_RESIDENCY_BUCKETS),
                histogram("vllm:kv_block_reuse_gap_seconds", "Histogram of time gaps between consecutive KV cache "
                          "block accesses. Sampled metrics (controlled by --kv-cache-metrics-sample).",
                          KV_BLOCK_RESIDENCY_BUCKETS),
            )
        # vLLM's LoRA gauge: one series, labelled with the adapters of the running and the waiting
        # requests, whose value is when it was last set (created with the first LoRA stats).
        self.lora_info: Any = None
        self.extras = LmcCollector(self.labels)
        registry.register(self.extras)
        self._preemptions_seen = 0
        # Speculative decoding (vLLM's spec_decode counters), created with the first stats that
        # carry them: the per-position series need num_speculative_tokens.
        self._spec_counters: tuple[Any, Any, Any, list[Any]] | None = None
        self._spec_seen: SpecDecodingStats | None = None

    # -- StatLoggerBase ---------------------------------------------------------------------
    def log_engine_initialized(self) -> None:
        self.cache_config_info.labels(engine=self.labels["engine"], **self.cache_info).set(1)

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self.observe_gauges(scheduler_stats)
            self.prefix_queries.inc(scheduler_stats.prefix_cache.queries)
            self.prefix_hits.inc(scheduler_stats.prefix_cache.hits)
            residency = scheduler_stats.kv_block_residency
            if residency is not None and self.kv_block_residency is not None:
                lifetime, idle, reuse_gap = self.kv_block_residency
                for value in residency.lifetimes_s:
                    lifetime.observe(value)
                for value in residency.idle_before_evict_s:
                    idle.observe(value)
                for value in residency.reuse_gaps_s:
                    reuse_gap.observe(value)
        if iteration_stats is None:
            return
        self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        num_tokens = iteration_stats.num_prompt_tokens + iteration_stats.num_generation_tokens
        if num_tokens:
            self.iteration_tokens.observe(num_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            self.ttft.observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            self.itl.observe(itl)
        for finished in iteration_stats.finished_requests:
            counter = self.success.get(finished.finish_reason)
            if counter is not None:
                counter.inc()
            self.e2e.observe(finished.e2e_latency)
            self.queue_time.observe(finished.queued_time)
            self.prefill_time.observe(finished.prefill_time)
            self.decode_time.observe(finished.decode_time)
            self.inference_time.observe(finished.inference_time)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)
            if finished.n_param is not None:
                self.request_params_n.observe(finished.n_param)
            if finished.max_tokens_param is not None:
                self.request_params_max_tokens.observe(finished.max_tokens_param)

    def log(self) -> None:
        """Nothing to print: Prometheus scrapes /metrics."""

    def record_aborted(self, num_requests: int) -> None:
        """Requests the server aborted (their final step never reaches the output processor)."""
        self.success["abort"].inc(num_requests)

    # -- gauges -----------------------------------------------------------------------------
    def observe_gauges(self, stats: SchedulerStats) -> None:
        """Set the gauges (and catch the preemption counter up) from one SchedulerStats."""
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        self.kv_usage.set(stats.kv_cache_usage)
        if stats.lora is not None:
            if self.lora_info is None:
                self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                                       ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                                       registry=self.registry)
            self.lora_info.clear()  # only the current adapters' series
            self.lora_info.labels(max_lora=str(stats.lora.max_lora),
                                  waiting_lora_adapters=",".join(stats.lora.waiting_lora_adapters),
                                  running_lora_adapters=",".join(stats.lora.running_lora_adapters)).set_to_current_time()
        # The core counts preemptions cumulatively: follow its total exactly.
        if stats.num_preemptions_total > self._preemptions_seen:
            self.preemptions.inc(stats.num_preemptions_total - self._preemptions_seen)
            self._preemptions_seen = stats.num_preemptions_total
        if stats.spec_decoding is not None:
            self._observe_spec_decoding(stats.spec_decoding)
        self.extras.last = stats

    def _observe_spec_decoding(self, spec: SpecDecodingStats) -> None:
        """Catch the spec_decode counters up with the core's cumulative totals."""
        if self._spec_counters is None:
            names = ["model_name", "engine"]

            def counter(name: str, doc: str) -> Any:
                return Counter(name, doc, names, registry=self.registry).labels(**self.labels)

            per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                              "Accepted tokens per draft position.", names + ["position"], registry=self.registry)
            self._spec_counters = (
                counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
                [per_pos.labels(position=str(i), **self.labels) for i in range(spec.num_spec_tokens)])
            self._spec_seen = SpecDecodingStats.new(spec.num_spec_tokens)
        seen = self._spec_seen
        assert seen is not None
        drafts, draft_tokens, accepted, per_position = self._spec_counters
        for metric, now, before in ((drafts, spec.num_drafts, seen.num_drafts),
                                    (draft_tokens, spec.num_draft_tokens, seen.num_draft_tokens),
                                    (accepted, spec.num_accepted_tokens, seen.num_accepted_tokens)):
            if now > before:
                metric.inc(now - before)
        for position, (now, before) in enumerate(zip(spec.num_accepted_tokens_per_pos,
                                                     seen.num_accepted_tokens_per_pos)):
            if now > before:
                per_position[position].inc(now - before)
        self._spec_seen = spec.copy()

    async def refresh(self, engine: AsyncLLM, timeout_s: float = 2.0) -> None:
        """Read the core's current gauges before a scrape (kept as they are if it cannot answer)."""
        if engine.errored:
            return
        try:
            stats = await asyncio.wait_for(engine.get_stats(), timeout_s)
        except Exception as error:  # noqa: BLE001 - a scrape must answer even then
            logger.debug("metrics refresh failed: %s", error)
            return
        self.observe_gauges(stats)


class LmcCollector(Collector):
    """lm-console's extras from the latest SchedulerStats: blocks, encoder cache, KV tiers."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.last: SchedulerStats | None = None

    def describe(self) -> list[Any]:
        return []  # the metric set depends on the model (encoder cache) and the KV connector (tiers)

    def collect(self) -> Any:
        stats = self.last
        if stats is None:
            return
        names, values = list(self.labels), list(self.labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        yield gauge("lmc:num_free_blocks", "Free KV blocks (cached-and-evictable ones included).",
                    stats.num_free_blocks)
        yield gauge("lmc:num_total_blocks", "Usable KV blocks (the null block excluded).", stats.num_total_blocks)
        yield counter("lmc:engine_steps", "Engine steps run since start-up.", stats.num_steps)
        encoder = stats.encoder_cache
        if encoder is not None:
            used = encoder.num_used_slots + encoder.num_freeable_slots
            yield gauge("lmc:encoder_cache_usage_perc", "Encoder-cache slots holding embeddings, 1 means full.",
                        used / encoder.num_slots if encoder.num_slots else 0.0)
            yield gauge("lmc:encoder_cache_entries", "Multimodal items in the encoder cache.", encoder.num_entries)
            yield counter("lmc:encoder_cache_lookups", "Encoder-cache lookups.", encoder.num_lookups)
            yield counter("lmc:encoder_cache_hits", "Encoder-cache hits.", encoder.num_hits)
            yield counter("lmc:encoder_runs", "Encoder forward runs.", encoder.num_encoder_runs)
            yield counter("lmc:encoder_cache_evictions", "Encoder-cache evictions.", encoder.num_evictions)
        if stats.kv_tiers:
            yield from _tier_families(stats, names, values)


def _tier_families(stats: SchedulerStats, names: list[str], values: list[str]) -> Any:
    tier_names = names + ["medium"]
    gauges = {"used_bytes": "Bytes held by the KV offload tier.",
              "capacity_bytes": "Capacity of the KV offload tier in bytes.",
              "num_chunks": "KV chunks held by the offload tier."}
    counters = {"hits": "Chunk lookups that hit the tier.", "misses": "Chunk lookups that missed the tier.",
                "bytes_in": "Bytes stored into the tier.", "bytes_out": "Bytes loaded from the tier.",
                "evictions": "Chunks evicted from the tier.", "errors": "Corrupt chunks and failed writes."}
    for kind, fields in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
        for field, doc in fields.items():
            family = kind(f"lmc:kv_tier_{field}", doc, labels=tier_names)
            for tier in stats.kv_tiers or ():
                family.add_metric([*values, tier.medium], getattr(tier, field))
            yield family


# vLLM's HTTP instrumentation (prometheus-fastapi-instrumentator) leaves these out, and so do we.
HTTP_UNCOUNTED = frozenset({"/metrics", "/health", "/load", "/ping", "/version", "/server_info"})


class HttpRequestsMiddleware:
    """ASGI middleware: vLLM's http_requests_total{handler, method, status} (status grouped: 2xx, 4xx, 5xx).

    Outermost, so a refusal by the server's gate (503 while draining or after the engine died)
    counts too: the fleet view's errors/s reads the 5xx. Pure ASGI (no BaseHTTPMiddleware), so
    streamed responses and client disconnects pass through untouched.
    """

    def __init__(self, app: Any, registry: CollectorRegistry) -> None:
        self.app = app
        self.counter = Counter("http_requests", "Total number of requests by method, status and handler.",
                               ["handler", "method", "status"], registry=registry)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in HTTP_UNCOUNTED:
            await self.app(scope, receive, send)
            return
        status = 500  # an exception before the response started is a server error

        async def send_counted(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            # The route's template, not the path (bounded cardinality); "none" when no route matched.
            route = scope.get("route")
            handler = getattr(route, "path", None) or "none"
            self.counter.labels(handler, scope.get("method", "?"), f"{status // 100}xx").inc()


def _cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The KV cache's element type as resolved ("int8", or the model's dtype for "auto")."""
    return model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def cache_config_info(engine: AsyncLLM) -> dict[str, str]:
    """The labels of vllm:cache_config_info, from the engine's arguments and ready info."""
    cache, model = engine.config.cache_config, engine.config.model_config
    return {
        "block_size": str(cache.block_size), "cache_dtype": _cache_dtype(cache.kv_cache_dtype, model.dtype),
        "enable_prefix_caching": str(cache.enable_prefix_caching),
        "gpu_memory_utilization": str(cache.gpu_memory_utilization), "num_gpu_blocks": str(cache.num_blocks),
        "num_gpu_blocks_override": str(cache.num_gpu_blocks_override), "num_cpu_blocks": "None",
        "prefix_caching_hash_algo": str(cache.prefix_caching_hash_algo),
    }


def make_stat_logger(engine: AsyncLLM, model_name: str) -> PrometheusStatLogger:
    """A PrometheusStatLogger in a fresh registry for one app."""
    return PrometheusStatLogger(CollectorRegistry(), model_name, engine.config.model_config.max_model_len,
                                cache_config_info(engine),
                                kv_cache_metrics=getattr(engine.config.cache_config, "kv_cache_metrics", False))
