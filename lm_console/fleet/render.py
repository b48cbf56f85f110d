"""The fleet row as text cells: one layout for the fleet view's table and `lmc top`'s."""

from __future__ import annotations

from lm_console.fleet.monitor import DOWN, UP, ServerRow

COLUMNS = ("server", "state", "run", "wait", "KV", "gen tok/s", "TTFT p50/p99", "ITL p50/p99", "prefix hit",
           "preempt/s", "err/s", "alerts")


def fmt_latency(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.1f}s"


def fmt_pair(low: float | None, high: float | None) -> str:
    return f"{fmt_latency(low)}/{fmt_latency(high)}"


def row_cells(row: ServerRow) -> list[str]:
    """The row's cells in COLUMNS order; a server that is not up has its state and error only."""
    kind = f" ({row.kind})" if row.kind else ""
    alerts = ", ".join(row.alerts) or "-"
    figures = row.figures
    if row.state != UP or figures is None:
        state = "DOWN" if row.state == DOWN else row.state
        return [row.name, f"{state}{kind}", *["-"] * (len(COLUMNS) - 3), alerts]
    return [row.name, f"up{kind}", str(figures.running), str(figures.waiting), f"{figures.kv_usage:.0%}",
            f"{figures.gen_tps:,.1f}", fmt_pair(figures.ttft_p50, figures.ttft_p99),
            fmt_pair(figures.itl_p50, figures.itl_p99),
            "-" if figures.prefix_hit_rate is None else f"{figures.prefix_hit_rate:.0%}",
            f"{figures.preemptions_per_s:.2f}", f"{figures.errors_per_s:.2f}", alerts]
