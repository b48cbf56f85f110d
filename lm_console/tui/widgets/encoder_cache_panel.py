"""EncoderCachePanel: the encoder cache of a vision-language model (hidden for text-only ones).

Slots are encoder embeddings: used (a request references the entry), freeable (kept for
reuse, evicted only when space is needed), free. Counters are cumulative.
"""

from __future__ import annotations

from textual.widgets import Static

from lm_console.engine.metrics.stats import EncoderCacheStats
from lm_console.tui.render import fmt_count, fmt_pct


def usage_bar(sample: EncoderCacheStats, width: int) -> str:
    """█ used, ▒ freeable, · free, proportional to the slots."""
    total = max(sample.num_slots, 1)
    used = round(width * sample.num_used_slots / total)
    freeable = min(round(width * sample.num_freeable_slots / total), width - used)
    return f"[#61afef]{'█' * used}[/][#e5c07b]{'▒' * freeable}[/][#5c6370]{'·' * (width - used - freeable)}[/]"


class EncoderCachePanel(Static):
    """Entries, slots used / freeable / free, hit rate, encoder runs, loads and evictions."""

    def on_mount(self) -> None:
        self.border_title = "Encoder cache"
        self.display = False

    def show(self, sample: EncoderCacheStats | None) -> None:
        if sample is None:
            return
        self.display = True
        width = max(self.content_size.width - 2, 8)
        hit_rate = sample.num_hits / sample.num_lookups if sample.num_lookups else None
        self.update(
            f"{usage_bar(sample, width)}\n"
            f"{fmt_count(sample.num_entries)} entries · used {fmt_count(sample.num_used_slots)} · "
            f"freeable {fmt_count(sample.num_freeable_slots)} · free {fmt_count(sample.num_free_slots)} "
            f"of {fmt_count(sample.num_slots)} slots\n"
            f"hits {fmt_count(sample.num_hits)} ({fmt_pct(hit_rate)}) · encoder runs "
            f"{fmt_count(sample.num_encoder_runs)} · loaded {fmt_count(sample.num_external_loads)} · "
            f"evicted {fmt_count(sample.num_evictions)}"
        )
