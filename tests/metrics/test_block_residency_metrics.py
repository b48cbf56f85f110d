"""Sampled KV block residency end to end: engine core -> SchedulerStats -> vLLM's /metrics
histograms and the console's panel."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest

from lm_console.engine import AsyncLLM, SamplingParams
from lm_console.engine.entrypoints.openai.metrics import PrometheusStatLogger
from lm_console.engine.metrics.loggers import StatLoggerBase
from lm_console.engine.metrics.stats import KVBlockResidencyStats, SchedulerStats

NAMES = ("vllm:kv_block_lifetime_seconds", "vllm:kv_block_idle_before_evict_seconds", "vllm:kv_block_reuse_gap_seconds")


class Recorder(StatLoggerBase):
    def __init__(self) -> None:
        self.residency = KVBlockResidencyStats()

    def record(self, scheduler_stats, iteration_stats) -> None:  # type: ignore[no-untyped-def]
        if scheduler_stats is not None and scheduler_stats.kv_block_residency is not None:
            got = scheduler_stats.kv_block_residency
            self.residency.lifetimes_s += got.lifetimes_s
            self.residency.idle_before_evict_s += got.idle_before_evict_s
            self.residency.reuse_gaps_s += got.reuse_gaps_s

    def log(self) -> None:
        pass


def test_engine_reports_sampled_lifetimes(tiny_llama_dir) -> None:
    recorder = Recorder()

    async def main() -> None:
        # 12 usable blocks, every one sampled: the second wave evicts the first wave's blocks.
        async with AsyncLLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_gpu_blocks_override=13,
                            kv_cache_metrics=True, kv_cache_metrics_sample=1.0,
                            stat_loggers=[recorder]) as llm:
            shared = list(range(50, 66))  # one block, hit by every later wave
            for wave in range(4):  # 5 blocks each: wave 3 evicts wave 1's tail
                prompt = {"prompt_token_ids": shared + [100 + wave] * 60}
                async for _ in llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True)):
                    pass
            assert await llm.reset_prefix_cache()  # ends every sampled life, the shared block's too
            async for _ in llm.generate({"prompt_token_ids": [7] * 5}, SamplingParams(max_tokens=1)):
                pass  # a step, whose stats carry the reset's observations

    asyncio.run(main())
    residency = recorder.residency
    assert residency.lifetimes_s and len(residency.lifetimes_s) == len(residency.idle_before_evict_s)
    assert all(0 <= idle <= life for life, idle in zip(residency.lifetimes_s, residency.idle_before_evict_s))
    assert residency.reuse_gaps_s  # the shared first block was hit by waves 2 and 3
    assert all(gap >= 0 for gap in residency.reuse_gaps_s)


def test_prometheus_histograms_under_vllms_names() -> None:
    registry = CollectorRegistry()
    logger = PrometheusStatLogger(registry, "m", 128, {}, kv_cache_metrics=True)
    stats = SchedulerStats(kv_block_residency=KVBlockResidencyStats([0.5, 40.0], [0.2, 39.0], [0.01]))
    logger.record(stats, None)
    text = generate_latest(registry).decode()
    for name in NAMES:
        assert f"# TYPE {name} histogram" in text
    assert 'vllm:kv_block_lifetime_seconds_count{engine="0",model_name="m"} 2.0' in text
    assert 'vllm:kv_block_lifetime_seconds_sum{engine="0",model_name="m"} 40.5' in text
    assert 'vllm:kv_block_reuse_gap_seconds_bucket{engine="0",le="0.01",model_name="m"} 1.0' in text
    off = CollectorRegistry()
    PrometheusStatLogger(off, "m", 128, {}).record(stats, None)  # off: vLLM registers none of them
    assert "kv_block_lifetime" not in generate_latest(off).decode()


def test_console_panel_shows_the_histograms() -> None:
    from textual.app import App, ComposeResult

    from lm_console.request_book import RequestBook
    from lm_console.tui.telemetry import Telemetry
    from lm_console.tui.widgets.block_residency_panel import BlockResidencyPanel, histogram_bars

    telemetry = Telemetry(RequestBook())
    telemetry.add_stats(SchedulerStats(timestamp=1.0))
    assert telemetry.flush(1.0).block_residency is None  # metrics off: the panel stays hidden
    telemetry.add_stats(SchedulerStats(timestamp=2.0, kv_block_residency=KVBlockResidencyStats(
        [0.5, 0.5, 40.0], [0.2, 0.3, 39.0], [0.01])))
    view = telemetry.flush(2.0)
    residency = view.block_residency
    assert residency is not None and residency.lifetime.total == 3 and residency.reuse_gap.total == 1
    assert residency.lifetime.quantile(0.5) == 0.5
    bars = histogram_bars(residency.lifetime)
    assert bars[8] == "█" and bars[15] == "▄" and bars.count(" ") == len(bars) - 2  # the le=0.5 s and le=60 s buckets

    class PanelApp(App):
        def compose(self) -> ComposeResult:
            yield BlockResidencyPanel()

    async def main() -> None:
        app = PanelApp()
        async with app.run_test() as pilot:
            panel = app.query_one(BlockResidencyPanel)
            assert not panel.display
            panel.show(residency)
            await pilot.pause()
            assert panel.display and "n 3/3/1" in str(panel.border_subtitle)
            rendered = str(panel.render())
            assert "life" in rendered and "reuse" in rendered and "500 ms" in rendered

    asyncio.run(main())
