"""Small text renderers shared by the panels: sparklines, bars and number formats."""

from __future__ import annotations

import time
from collections.abc import Sequence

SPARK_CHARS = "▁▂▃▄▅▆▇█"
BAR_EIGHTHS = " ▏▎▍▌▋▊▉"


def sparkline(values: Sequence[float], width: int, maximum: float | None = None) -> str:
    """The last `width` values as one row of block characters (blank when there are none)."""
    values = list(values)[-width:]
    if not values:
        return " " * width
    top = maximum if maximum is not None else max(values)
    if top <= 0:
        chars = SPARK_CHARS[0] * len(values)
    else:
        last = len(SPARK_CHARS) - 1
        chars = "".join(SPARK_CHARS[min(last, max(0, round(v / top * last)))] for v in values)
    return chars.rjust(width, " ")


def bar(fraction: float, width: int) -> str:
    """A horizontal bar `width` cells wide, filled to `fraction` with eighth-cell precision."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    text = "█" * full + (BAR_EIGHTHS[part] if part and full < width else "")
    return text.ljust(width)


def fmt_count(value: int | float) -> str:
    """Thousands separated: 12,834."""
    return f"{int(value):,}"


def fmt_seconds(value: float | None) -> str:
    """Seconds as ms below 1 s, else s with one decimal; '-' when unknown."""
    if value is None:
        return "-"
    if value < 1.0:
        return f"{value * 1000:.0f} ms"
    return f"{value:.1f} s"


def fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def fmt_rate(value: float) -> str:
    """Tokens per second, compact."""
    return f"{value:,.0f}" if value >= 10 else f"{value:.1f}"


def fmt_clock(ts: float) -> str:
    """Wall-clock time of day with milliseconds (local time)."""
    return time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts * 1000) % 1000:03d}"


def short_hash(value: str | None, length: int = 8) -> str:
    return "-" if not value else value[:length] + "…"
