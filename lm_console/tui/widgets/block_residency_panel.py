"""BlockResidencyPanel: histograms of sampled KV block lifetimes, idle-before-evict and reuse gaps.

Hidden until the engine reports observations (the engine runs with kv_cache_metrics on). One
row per series (lifetime, idle before eviction, reuse gap): a bar per bucket (1 ms .. 30 min,
log-spaced, as vLLM's) and the median's bucket; the subtitle counts the observations.
"""

from __future__ import annotations

from textual.widgets import Static

from lm_console.tui.block_residency import BlockResidency, Histogram
from lm_console.tui.render import fmt_seconds

_BARS = " ▁▂▃▄▅▆▇█"


def histogram_bars(histogram: Histogram) -> str:
    """One character per bucket, scaled to the fullest bucket."""
    peak = max(histogram.counts) or 1
    return "".join(_BARS[0 if not c else max(1, round(c / peak * (len(_BARS) - 1)))] for c in histogram.counts)


class BlockResidencyPanel(Static):
    """Three histogram rows; the subtitle gives the bucket range."""

    def on_mount(self) -> None:
        self.border_title = "KV block residency"
        self.display = False

    def show(self, residency: BlockResidency | None) -> None:
        if residency is None or not residency.lifetime.total + residency.reuse_gap.total:
            return
        self.display = True
        lines = []
        for name, histogram in residency.series():
            median = histogram.quantile(0.5)
            lines.append(f"{name:<5} [#61afef]{histogram_bars(histogram)}[/] "
                         f"{fmt_seconds(median) if median is not None else '-':>6}")
        self.update("\n".join(lines))
        self.border_subtitle = (f"1ms…30min · n {residency.lifetime.total}/{residency.idle.total}"
                                f"/{residency.reuse_gap.total}")
