"""Summary blocks in vLLM's layout, the --baseline ratio, and --save-result JSON."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any


def header(title: str) -> str:
    return "{s:{c}^{n}}".format(s=f" {title} ", n=50, c="=")


def section(title: str) -> str:
    return "{s:{c}^{n}}".format(s=title, n=50, c="-")


def line(label: str, value: Any) -> str:
    if isinstance(value, float):
        return "{:<40} {:<10.2f}".format(label, value)
    return "{:<40} {:<10}".format(label, value)


def baseline_lines(ours: float, baseline: dict[str, Any] | None) -> list[str]:
    """The baseline block: HF's best configuration, its output tok/s, and our ratio."""
    if baseline is None:
        return []
    ratio = ours / baseline["output_tokens_per_second"] if baseline["output_tokens_per_second"] else float("inf")
    return [
        section("Baseline: HF transformers"),
        line("Best configuration:", f"{baseline['dtype']}, batch {baseline['batch_size']}"),
        line("Output token throughput (tok/s):", float(baseline["output_tokens_per_second"])),
        line("Ratio (lm-console / HF):", float(ratio)),
        f"ratio vs HF's best ({baseline['system']}): {ratio:.2f}x",
    ]


def save_result(path: str | None, result: dict[str, Any]) -> None:
    """Write the result JSON with a date, as vLLM's --save-result does."""
    if not path:
        return
    result = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), **result}
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    from lm_console.bench.latency_plot import save_latency_plot

    plot = save_latency_plot(path, result)  # serve runs: their latency histograms, next to the JSON
    if plot is not None:
        print(f"Latency plot: {plot}")
