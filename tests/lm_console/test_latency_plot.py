"""The hand-written latency SVG of `lmc bench serve`: samples per metric, bars, axes, percentiles."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from lm_console.bench.latency_plot import latency_samples, latency_svg, nice_ticks, plot_path


def result() -> dict:
    return {"ttfts": [0.1, 0.2, 0.3, 0.0], "latencies": [1.1, 1.2, 2.3, 0.0], "output_lens": [11, 11, 1, 0],
            "itls": [[0.1] * 10, [0.1] * 10, [], []], "errors": ["", "", "", "boom"]}


def test_samples_leave_failed_requests_out_and_use_ms() -> None:
    samples = latency_samples(result())
    assert samples["ttft"] == [100.0, 200.0, 300.0]
    assert [round(x, 6) for x in samples["tpot"]] == [100.0, 100.0]  # (1.1 - 0.1) / 10; one-token requests have none
    assert len(samples["itl"]) == 20 and samples["e2el"] == [1100.0, 1200.0, 2300.0]


def test_svg_is_well_formed_with_a_panel_per_metric() -> None:
    svg = latency_svg(result(), "run A")
    root = ET.fromstring(svg)
    texts = ["".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert any("run A" in t for t in texts)
    for title in ("TTFT", "TPOT", "ITL", "E2EL"):
        assert any(t.startswith(title) for t in texts)
    assert any(t.startswith("p50 ") for t in texts) and any(t.startswith("p99 ") for t in texts)
    bars = [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.get("fill") != "white"]
    assert len(bars) == 4 * 30
    assert plot_path("/tmp/x/run.json").name == "run.latency.svg"


def test_nice_ticks() -> None:
    assert nice_ticks(10.0) == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert nice_ticks(0.0) == [0.0]
