"""The latency distributions of a `lmc bench serve` run as one small SVG (written by hand, no plot library).

Four histograms (TTFT, TPOT, ITL, E2EL) with axes in ms, their p50 and p99 marked; saved next to
the result JSON (`--save-result run.json` -> `run.latency.svg`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import numpy as np

PANEL_W, PANEL_H = 420, 240
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 56, 16, 34, 40
BINS = 30
COLOURS = {"ttft": "#4f8fd0", "tpot": "#3fa34d", "itl": "#c678dd", "e2el": "#d19a66"}
TITLES = {"ttft": "TTFT: time to first token", "tpot": "TPOT: time per output token",
          "itl": "ITL: inter-token latency", "e2el": "E2EL: end-to-end latency"}


def latency_samples(result: dict[str, Any]) -> dict[str, list[float]]:
    """Per-metric samples in ms from a serve result's per-request lists (failed requests left out)."""
    errors = result.get("errors") or [""] * len(result.get("ttfts", []))
    ok = [i for i, error in enumerate(errors) if not error]
    ttfts, lats, outs = result.get("ttfts", []), result.get("latencies", []), result.get("output_lens", [])
    itls = result.get("itls", [])
    return {
        "ttft": [ttfts[i] * 1000 for i in ok if i < len(ttfts)],
        "tpot": [(lats[i] - ttfts[i]) / (outs[i] - 1) * 1000 for i in ok
                 if i < len(lats) and i < len(outs) and outs[i] > 1],
        "itl": [x * 1000 for i in ok if i < len(itls) for x in itls[i]],
        "e2el": [lats[i] * 1000 for i in ok if i < len(lats)],
    }


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to about `top`."""
    if top <= 0:
        return [0.0]
    raw = top / count
    magnitude = 10 ** np.floor(np.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [float(step * i) for i in range(int(top // step) + 1)]


def _panel(name: str, values: list[float], x0: float, y0: float) -> list[str]:
    plot_w, plot_h = PANEL_W - MARGIN_L - MARGIN_R, PANEL_H - MARGIN_T - MARGIN_B
    left, top = x0 + MARGIN_L, y0 + MARGIN_T
    out = [f'<text x="{left}" y="{y0 + 20}" class="title">{escape(TITLES[name])} '
           f'<tspan class="dim">({len(values)} samples)</tspan></text>']
    if not values:
        out.append(f'<text x="{left + plot_w / 2}" y="{top + plot_h / 2}" class="dim" text-anchor="middle">no samples</text>')
        return out
    hi = max(values) * 1.05 or 1.0
    counts, edges = np.histogram(values, bins=BINS, range=(0.0, hi))
    peak = max(int(counts.max()), 1)
    bar_w = plot_w / BINS
    for i, count in enumerate(counts):
        h = count / peak * plot_h
        out.append(f'<rect x="{left + i * bar_w:.1f}" y="{top + plot_h - h:.1f}" width="{max(bar_w - 1, 1):.1f}" '
                   f'height="{h:.1f}" fill="{COLOURS[name]}"/>')
    # Axes, ticks and labels.
    out.append(f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" class="axis"/>')
    out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" class="axis"/>')
    for tick in nice_ticks(hi):
        x = left + tick / hi * plot_w
        out.append(f'<line x1="{x:.1f}" y1="{top + plot_h}" x2="{x:.1f}" y2="{top + plot_h + 4}" class="axis"/>')
        out.append(f'<text x="{x:.1f}" y="{top + plot_h + 16}" text-anchor="middle">{tick:g}</text>')
    for tick in nice_ticks(peak, 4):
        y = top + plot_h - tick / peak * plot_h
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{tick:g}</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{top + plot_h + 32}" text-anchor="middle" class="dim">ms</text>')
    out.append(f'<text x="{x0 + 14}" y="{top + plot_h / 2}" class="dim" transform="rotate(-90 {x0 + 14} '
               f'{top + plot_h / 2})" text-anchor="middle">requests</text>')
    for q, dash in ((50, "4 3"), (99, "1 3")):
        value = float(np.percentile(values, q))
        x = left + value / hi * plot_w
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + plot_h}" stroke="#222" '
                   f'stroke-dasharray="{dash}"/>')
        out.append(f'<text x="{x + 3:.1f}" y="{top + 10 + (12 if q == 99 else 0)}" class="mark">p{q} {value:.1f}</text>')
    return out


def latency_svg(result: dict[str, Any], title: str = "lmc bench serve") -> str:
    """The SVG text: a 2x2 grid of histograms."""
    samples = latency_samples(result)
    width, height = 2 * PANEL_W, 2 * PANEL_H + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, sans-serif" font-size="11">',
             "<style>.title{font-size:13px;font-weight:bold}.dim{fill:#777}.axis{stroke:#444}"
             ".mark{font-size:10px}</style>",
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="12" y="20" class="title">{escape(title)}: latency distributions</text>']
    for index, name in enumerate(("ttft", "tpot", "itl", "e2el")):
        parts += _panel(name, samples[name], (index % 2) * PANEL_W, 30 + (index // 2) * PANEL_H)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def plot_path(json_path: str | Path) -> Path:
    """run.json -> run.latency.svg (next to it)."""
    path = Path(json_path)
    return path.with_name(path.stem + ".latency.svg")


def save_latency_plot(json_path: str | Path, result: dict[str, Any]) -> Path | None:
    """Write the plot next to the JSON when the result has per-request latencies; its path or None."""
    if not result.get("ttfts"):
        return None
    path = plot_path(json_path)
    path.write_text(latency_svg(result, str(result.get("label") or "lmc bench serve")))
    return path
