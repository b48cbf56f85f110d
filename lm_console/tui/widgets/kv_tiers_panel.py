"""KVTiersPanel: the KV offload tiers (CPU RAM, disk): usage, hit rate, bytes moved.

Hidden until the engine reports tiers (an engine with an offloading KV connector).
"""

from __future__ import annotations

from textual.widgets import Static

from lm_console.tui.render import bar, fmt_pct
from lm_console.tui.telemetry import DashboardView


def fmt_bytes(value: float) -> str:
    """Compact bytes: 812, 12K, 3.4M, 1.2G."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if value >= scale:
            number = value / scale
            return f"{number:.1f}{unit}" if number < 10 else f"{number:.0f}{unit}"
    return f"{value:.0f}"


class KVTiersPanel(Static):
    """One line per tier: usage bar, hit rate, bytes stored (↑) and loaded (↓) since start."""

    def on_mount(self) -> None:
        self.border_title = "KV tiers"
        self.display = False

    def show(self, view: DashboardView) -> None:
        if not view.kv_tiers:
            return
        self.display = True
        lines = []
        for tier in view.kv_tiers:
            usage = tier.used_bytes / tier.capacity_bytes if tier.capacity_bytes else 0.0
            lookups = tier.hits + tier.misses
            hit_rate = tier.hits / lookups if lookups else None
            lines.append(f"{tier.medium:<4} [#61afef]{bar(usage, 6)}[/] {fmt_pct(usage):>4} hit {fmt_pct(hit_rate):>4}"
                         f" ↑{fmt_bytes(tier.bytes_in)} ↓{fmt_bytes(tier.bytes_out)}")
        self.update("\n".join(lines))
        rates = " ".join(f"{m} ↑{fmt_bytes(i)}/s ↓{fmt_bytes(o)}/s" for m, (i, o) in view.kv_tier_rates.items())
        errors = sum(t.errors for t in view.kv_tiers)
        evictions = sum(t.evictions for t in view.kv_tiers)
        self.border_subtitle = f"{rates} · evict {evictions}" + (f" · [red]err {errors}[/]" if errors else "")
