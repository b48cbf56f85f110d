"""The console's block map: the cost of one frame at 1,000 / 10,000 / 100,000 blocks.

A frame is what one UI tick does when a new block map arrives: Telemetry folds it (state counts,
block ages: O(pool) in C / numpy) and the BlockMap takes it and draws the rows in view (Line API,
O(rows x columns x zoom)). The map is a 200x50 widget; the pool a random mix of free, cached and
in-use blocks, a new one every frame. Median wall time over the frames, one run.

    python benchmarks/block_map_frame.py [--frames 40]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from textual.app import App, ComposeResult

from lm_console.engine.metrics.stats import SchedulerStats
from lm_console.request_book import RequestBook
from lm_console.tui.telemetry import Telemetry
from lm_console.tui.widgets.block_map import BlockMap

SIZES = (1_000, 10_000, 100_000)
ZOOMS = (1, 16, 64)
WIDTH, HEIGHT = 200, 50


def pools(num_blocks: int, count: int, seed: int = 0) -> list[tuple[bytes, bytes]]:
    """`count` random block maps (states, ref counts) of one size, each a little different."""
    rng = random.Random(seed)
    states = bytearray(rng.choices((0, 1, 2), weights=(5, 4, 1), k=num_blocks))
    states[0] = 3
    maps = []
    for _ in range(count):
        for _ in range(max(num_blocks // 100, 1)):  # 1% of the blocks change per frame
            states[rng.randrange(1, num_blocks)] = rng.choice((0, 1, 2))
        refs = bytes(min(s, 1) * rng.choice((1, 1, 1, 2, 3)) for s in states)
        maps.append((bytes(states), refs))
    return maps


class MapApp(App[None]):
    def compose(self) -> ComposeResult:
        yield BlockMap(id="map")


async def measure(frames: int) -> list[tuple[int, int, float, float]]:
    """(blocks, zoom, fold ms, draw ms) medians."""
    rows = []
    app = MapApp()
    async with app.run_test(size=(WIDTH, HEIGHT)) as pilot:
        block_map = app.query_one(BlockMap)
        for num_blocks in SIZES:
            maps = pools(num_blocks, frames)
            for zoom in ZOOMS:
                block_map.set_zoom(zoom)
                telemetry = Telemetry(RequestBook())
                block_map.scroll_to(y=0, animate=False, immediate=True)
                await pilot.pause()
                fold_ms, draw_ms = [], []
                for index, (states, refs) in enumerate(maps):
                    stats = SchedulerStats(num_total_blocks=num_blocks - 1, timestamp=float(index),
                                           block_states=states, block_ref_counts=refs)
                    start = time.perf_counter()
                    telemetry.add_stats(stats)
                    view = telemetry.flush(float(index))
                    middle = time.perf_counter()
                    block_map.set_blocks(view.block_states, view.block_ref_counts)
                    for y in range(block_map.size.height):
                        block_map.render_line(y)
                    end = time.perf_counter()
                    fold_ms.append((middle - start) * 1e3)
                    draw_ms.append((end - middle) * 1e3)
                rows.append((num_blocks, zoom, statistics.median(fold_ms), statistics.median(draw_ms)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=40)
    args = parser.parse_args()
    print(f"block map frame, {WIDTH}x{HEIGHT} cells, median of {args.frames} frames (ms)")
    print(f"{'blocks':>8} {'zoom':>5} {'fold':>7} {'draw':>7} {'frame':>7}")
    for num_blocks, zoom, fold, draw in asyncio.run(measure(args.frames)):
        print(f"{num_blocks:>8,} {zoom:>5} {fold:7.2f} {draw:7.2f} {fold + draw:7.2f}")


if __name__ == "__main__":
    main()
