"""GET /metrics: vLLM v1's names, types and labels, parsed by prometheus-client's own parser;
counters move as requests finish and agree with the responses' usage and the engine's stats."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from openai_server_helpers import ThreadServer, parse_metrics, sample_value

pytestmark = pytest.mark.slow

ENGINE_ARGS = dict(dtype="float32", max_model_len=256, num_threads=1, stat_loggers=[])
LABELS = {"model_name": "tiny", "engine": "0"}
GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
COUNTERS = ["vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
            "vllm:generation_tokens", "vllm:request_success"]
HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
              "vllm:request_generation_tokens", "vllm:iteration_tokens_total"]
PROMPTS = ["The history of computing is a story of abstractions stacked on one another. " * 3,
           "Gardens teach a similar lesson: a gardener plans the beds and waters them at dawn.",
           "Cities, too, are layered systems: pipes under streets, streets under traffic rules."]


def make_server(model_dir, num_blocks: int) -> ThreadServer:
    from lm_console.engine.entrypoints.openai.settings import ServerSettings

    return ThreadServer(str(model_dir), ServerSettings(served_model_names=("tiny",)),
                        num_gpu_blocks_override=num_blocks, **ENGINE_ARGS)


def scrape(server: ThreadServer) -> dict:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return parse_metrics(response.text)


def run_requests(server: ThreadServer, bodies: list[dict]) -> list[dict]:
    async def main() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            responses = await asyncio.gather(*(http.post("/v1/completions", json=body) for body in bodies))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        return [r.json()["usage"] for r in responses]

    return asyncio.run(main())


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    srv = make_server(tiny_llama_dir, num_blocks=512)
    yield srv
    srv.stop()


def test_names_types_and_labels_match_vllm(server) -> None:
    families = scrape(server)
    for name in GAUGES:
        assert families[name].type == "gauge", name
    for name in COUNTERS:
        assert families[name].type == "counter", name
    for name in HISTOGRAMS:
        assert families[name].type == "histogram", name
        buckets = [s for s in families[name].samples if s.name == name + "_bucket"]
        assert buckets and buckets[-1].labels["le"] == "+Inf"
    for name in GAUGES + COUNTERS + HISTOGRAMS:
        for sample in families[name].samples:
            assert {k: sample.labels[k] for k in LABELS} == LABELS, (name, sample)
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort"}
    info = families["vllm:cache_config_info"]
    assert info.type == "gauge"
    (sample,) = info.samples
    assert sample.value == 1 and sample.labels["block_size"] == "16" and sample.labels["num_gpu_blocks"] == "512"
    assert sample.labels["engine"] == "0"
    ttft_buckets = [float(s.labels["le"]) for s in families["vllm:time_to_first_token_seconds"].samples
                    if s.name.endswith("_bucket")][:-1]
    assert ttft_buckets[:3] == [0.001, 0.005, 0.01] and ttft_buckets[-1] == 2560.0
    token_buckets = [s.labels["le"] for s in families["vllm:request_prompt_tokens"].samples
                     if s.name.endswith("_bucket")]
    assert token_buckets == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "+Inf"]


def test_counters_move_with_finished_requests_and_agree_with_the_engine(server) -> None:
    before = scrape(server)
    bodies = [{"prompt": PROMPTS[i % 3], "max_tokens": 5 + i, "temperature": 0.0, "ignore_eos": True}
              for i in range(9)]
    usages = run_requests(server, bodies[:3]) + run_requests(server, bodies[3:])  # later ones hit the cache
    server.wait_idle()
    after = scrape(server)

    def delta(name: str, suffix: str = "_total", **labels: str) -> float:
        return (sample_value(after, name, suffix, **LABELS, **labels)
                - sample_value(before, name, suffix, **LABELS, **labels))

    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    completion_tokens = sum(u["completion_tokens"] for u in usages)
    cached_tokens = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert completion_tokens == sum(5 + i for i in range(9)) and cached_tokens > 0
    assert delta("vllm:prompt_tokens") == prompt_tokens
    assert delta("vllm:generation_tokens") == completion_tokens
    assert delta("vllm:request_success", finished_reason="length") == 9
    assert delta("vllm:request_success", finished_reason="stop") == 0
    assert delta("vllm:prefix_cache_queries") == prompt_tokens  # one lookup per request (no preemption)
    assert delta("vllm:prefix_cache_hits") == cached_tokens
    assert delta("vllm:request_prompt_tokens", "_sum") == prompt_tokens
    assert delta("vllm:request_generation_tokens", "_sum") == completion_tokens
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens"):
        assert delta(name, "_count") == 9, name
    assert delta("vllm:inter_token_latency_seconds", "_count") == completion_tokens - 9
    assert delta("vllm:iteration_tokens_total", "_sum") == prompt_tokens + completion_tokens
    # vLLM's HTTP counter, status grouped; a refused request is a 4xx (the fleet's errors/s reads 5xx).
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400
    http_after = scrape(server)

    def http_count(families: dict, status: str) -> float:  # 0 before the first such request
        return sum(s.value for s in families["http_requests"].samples if s.name == "http_requests_total"
                   and s.labels == {"handler": "/v1/completions", "method": "POST", "status": status})

    assert http_count(http_after, "2xx") - http_count(before, "2xx") == 9
    assert http_count(http_after, "4xx") - http_count(before, "4xx") == 1
    assert not [s for s in http_after["http_requests"].samples if s.labels.get("handler") == "/metrics"]

    stats = server.call(server.engine.get_stats())
    assert sample_value(after, "vllm:num_requests_running", **LABELS) == stats.num_running_reqs == 0
    assert sample_value(after, "vllm:num_requests_waiting", **LABELS) == stats.num_waiting_reqs == 0
    assert sample_value(after, "vllm:kv_cache_usage_perc", **LABELS) == pytest.approx(stats.kv_cache_usage)
    assert sample_value(after, "vllm:num_preemptions", "_total", **LABELS) == stats.num_preemptions_total
    pool = server.call(server.engine.get_block_pool_state())
    assert sample_value(after, "lmc:num_free_blocks", **LABELS) == pool.num_free_blocks == pool.num_total_blocks
    assert sample_value(after, "lmc:num_total_blocks", **LABELS) == pool.num_total_blocks
    assert sample_value(after, "lmc:engine_steps", "_total", **LABELS) == stats.num_steps


def test_preemptions_are_counted_as_the_engine_counts_them(tiny_llama_dir) -> None:
    server = make_server(tiny_llama_dir, num_blocks=24)  # 23 usable blocks: concurrent requests preempt
    try:
        bodies = [{"prompt": PROMPTS[i % 3] + str(i), "max_tokens": 120, "temperature": 0.0, "ignore_eos": True}
                  for i in range(6)]
        usages = run_requests(server, bodies)
        server.wait_idle()
        families = scrape(server)
        stats = server.call(server.engine.get_stats())
        assert stats.num_preemptions_total > 0
        assert sample_value(families, "vllm:num_preemptions", "_total", **LABELS) == stats.num_preemptions_total
        assert sample_value(families, "vllm:generation_tokens", "_total", **LABELS) == \
            sum(u["completion_tokens"] for u in usages) == 720
        assert sample_value(families, "vllm:request_success", "_total", finished_reason="length", **LABELS) == 6
        assert sample_value(families, "vllm:num_requests_running", **LABELS) == 0
    finally:
        server.stop()


def test_spec_decode_counters_follow_the_engine(tiny_llama_dir) -> None:
    """vllm:spec_decode_* (vLLM's names) equal the core's cumulative SpecDecodingStats."""
    from lm_console.engine.entrypoints.openai.settings import ServerSettings

    server = ThreadServer(str(tiny_llama_dir), ServerSettings(served_model_names=("tiny",)),
                          num_gpu_blocks_override=512, speculative_config={
                              "method": "suffix", "num_speculative_tokens": 3, "prompt_lookup_min": 1}, **ENGINE_ARGS)
    try:
        bodies = [{"prompt": PROMPTS[i % 3] * 2, "max_tokens": 48, "temperature": 0.0, "ignore_eos": True}
                  for i in range(4)]
        usages = run_requests(server, bodies)
        server.wait_idle()
        families = scrape(server)
        spec = server.call(server.engine.get_stats()).spec_decoding
        assert spec is not None and spec.num_drafts > 0
        assert sample_value(families, "vllm:spec_decode_num_drafts", "_total", **LABELS) == spec.num_drafts
        assert sample_value(families, "vllm:spec_decode_num_draft_tokens", "_total", **LABELS) == spec.num_draft_tokens
        assert sample_value(families, "vllm:spec_decode_num_accepted_tokens", "_total", **LABELS) == \
            spec.num_accepted_tokens
        per_pos = [sample_value(families, "vllm:spec_decode_num_accepted_tokens_per_pos", "_total", position=str(i),
                                **LABELS) for i in range(3)]
        assert per_pos == spec.num_accepted_tokens_per_pos and sum(per_pos) == spec.num_accepted_tokens
        assert sum(u["completion_tokens"] for u in usages) == 4 * 48
    finally:
        server.stop()
