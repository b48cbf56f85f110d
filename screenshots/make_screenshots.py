"""Regenerate the console screenshots from the real engine (SVG, and PNG for the README).

    python screenshots/make_screenshots.py              # run the engine: every scene (minutes on a CPU)
    python screenshots/make_screenshots.py --replay     # re-render from the recordings (seconds, no engine)
    python screenshots/make_screenshots.py --scene image_chat   # one scene (e.g. after demo-vlm changed)
    python screenshots/make_screenshots.py --vllm http://127.0.0.1:8000 --kv-events-endpoint tcp://127.0.0.1:5557
                                                        # vllm_dashboard: the console on a running vLLM server

Each scene drives `lmc tui` / `lmc chat` over the real engine stepped by hand (SteppedEngineClient:
the embedded SmolLM2, or demo-vlm for the image chat) on a fixed clock, with fixed seeds, so a
picture is a function of the model, the seeds and the scene. What the engine gave the console is
recorded (scenes/NAME.json); tests/lm_console/test_screenshots.py replays the recordings and fails
when a committed SVG's text no longer matches what the app renders. PNGs need cairosvg
(`pip install -e '.[screenshots]'`) or rsvg-convert.
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTHONHASHSEED", "0")  # the root of the block hashes (read when the engine loads)
os.environ["TZ"] = "UTC"  # the event log prints times of day

import argparse  # noqa: E402
import asyncio  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

HERE = Path(__file__).resolve().parent
SCENES_DIR = HERE / "scenes"
IMAGE = HERE / "scenes" / "two_red_squares.png"
PNG_FONT = "DejaVu Sans Mono"
SIZE = (120, 36)
DASHBOARD_ENGINE = dict(dtype="float32", max_model_len=1024, num_gpu_blocks_override=160, max_num_seqs=12,
                        max_num_batched_tokens=128, seed=0)
CHAT_ENGINE = dict(dtype="float32", max_model_len=2048, num_gpu_blocks_override=160, seed=0)
QUESTION = "What does a paged KV cache buy me? Two sentences."
IMAGE_QUESTION = "Describe the picture."


def make_picture(path: Path) -> None:
    """The image chat's picture: two red squares on the left, drawn as demo-vlm's training
    pictures are (lm_console/engine/models/demo_vlm_pictures.py), so the reply shows what it sees."""
    from lm_console.engine.models.demo_vlm_pictures import Scene, draw_scene

    path.parent.mkdir(parents=True, exist_ok=True)
    draw_scene(Scene(shape="square", colour="red", count=2, position="left"), seed=0).save(path)


# -- scenes: the same code drives the engine (recording) and the replay ------------------------------
async def dashboard_scene(client: Any, clock: Any, shoot: Callable[[Any, str], Awaitable[None]]) -> None:
    """The dashboard under load, a request's inspector, the charts and the help."""
    from lm_console.load_generator import LoadShape
    from lm_console.tui.app import ConsoleApp
    from lm_console.tui.demo import drive_load
    from lm_console.tui.widgets.request_table import RequestTable

    shape = LoadShape(rate=4.0, prompt_len=(48, 144), output_len=(16, 64), shared_prefix_share=0.75,
                      prefix_len=48, num_prefixes=1)
    app = ConsoleApp(client, shape=shape, clock=clock, tick_hz=0, seed=0)
    app.animation_level = "none"  # the tab underline slides: a picture mid-animation is not reproducible
    async with app.run_test(size=SIZE) as pilot:
        await drive_load(app, client, clock, num_steps=72)
        await pilot.pause()
        await shoot(app, "dashboard")
        # The inspector: the running request holding the most shared blocks.
        core = app.core_requests
        holders: dict[int, int] = {}
        for row in core.requests:
            for block in {b for group in row.block_ids for b in group}:
                holders[block] = holders.get(block, 0) + 1
        running = [r for r in core.requests if r.status == "RUNNING"]
        chosen = max(running, key=lambda r: (sum(holders[b] > 1 for g in r.block_ids for b in g), r.request_id))
        await pilot.press("t")
        table = app.query_one(RequestTable)
        table.move_cursor(row=table.get_row_index(chosen.request_id))
        await pilot.press("enter")
        await pilot.pause()
        app.tick()
        await pilot.pause()
        await shoot(app, "inspector")
        await pilot.press("escape")
        app.action_show_tab("charts")
        await pilot.pause()
        app.tick()
        await pilot.pause()
        await shoot(app, "charts")
        app.action_show_tab("dashboard")
        await pilot.press("question_mark")
        await pilot.pause()
        await shoot(app, "help")
        await app.load.close()


async def chat_scene(client: Any, clock: Any, shoot: Callable[[Any, str], Awaitable[None]]) -> None:
    """`lmc tui`'s chat tab with the embedded model's own reply."""
    from lm_console.client.types import GenParams
    from lm_console.tui.app import ConsoleApp
    from lm_console.tui.demo import drive_chat

    app = ConsoleApp(client, clock=clock, tick_hz=0, seed=0)
    app.animation_level = "none"
    app.session.params = GenParams(temperature=0.7, top_p=0.95, max_tokens=72, seed=0)  # the side panel shows them
    async with app.run_test(size=SIZE) as pilot:
        while app.load is None:
            await asyncio.sleep(0.01)
        app.action_show_tab("chat")
        await drive_chat(app, client, clock, QUESTION)
        await pilot.pause()
        await shoot(app, "chat")


async def image_chat_scene(client: Any, clock: Any, shoot: Callable[[Any, str], Awaitable[None]]) -> None:
    """`lmc chat --model demo-vlm --image two_red_squares.png`: the picture, its size and hash, the reply."""
    from lm_console.client.types import GenParams
    from lm_console.tui.app import ConsoleApp
    from lm_console.tui.demo import drive_chat

    app = ConsoleApp(client, clock=clock, tick_hz=0, seed=0, chat_only=True)
    app.animation_level = "none"
    app.initial_images = [str(IMAGE.relative_to(Path.cwd())) if IMAGE.is_relative_to(Path.cwd()) else str(IMAGE)]
    app.session.params = GenParams(temperature=0.0, max_tokens=48, seed=0)
    async with app.run_test(size=SIZE) as pilot:
        while app.load is None:
            await asyncio.sleep(0.01)
        await drive_chat(app, client, clock, IMAGE_QUESTION)
        await pilot.pause()
        # Scrolled to the end once the picture's widget has its size (while the reply streamed, the
        # end moved with that layout: the position was not reproducible).
        await pilot.pause()
        app.query_one("#transcript").scroll_end(animate=False, immediate=True)
        await pilot.pause()
        await shoot(app, "image_chat")


# scene -> (function, model (None: the embedded SmolLM2), engine args)
SCENES: dict[str, tuple[Callable[..., Awaitable[None]], str | None, dict[str, Any]]] = {
    "dashboard": (dashboard_scene, None, DASHBOARD_ENGINE),
    "chat": (chat_scene, None, CHAT_ENGINE),
    "image_chat": (image_chat_scene, "demo-vlm", CHAT_ENGINE),
}


async def run_scene(name: str, out_dir: Path, replay: bool) -> list[Path]:
    """Run one scene (over the engine, recording it, or over its recording); the SVGs it saved."""
    from lm_console.client.replay import Recording, ReplayClient
    from lm_console.tui.demo import ManualClock

    scene, model, engine_args = SCENES[name]
    clock = ManualClock()
    recording_path = SCENES_DIR / f"{name}.json"
    if replay:
        client: Any = ReplayClient(Recording.load(recording_path), clock=clock)
        recording = None
    else:
        from lm_console.client.stepped import SteppedEngineClient

        client = SteppedEngineClient(model, clock=clock, **engine_args)
        recording = client.start_recording()
    saved: list[Path] = []

    async def shoot(app: Any, shot: str) -> None:
        app.save_screenshot(f"{shot}.svg", str(out_dir))
        saved.append(out_dir / f"{shot}.svg")

    try:
        await scene(client, clock, shoot)
    finally:
        await client.shutdown()
    if recording is not None:
        SCENES_DIR.mkdir(exist_ok=True)
        recording.save(recording_path)
    return saved


async def vllm_shot(url: str, kv_events_endpoint: str, out_dir: Path) -> Path:
    """`lmc tui --url` on a running vLLM server (KV events on) under `lmc bench serve --url` load.

    Not a replayed scene: vLLM is not deterministic on a CPU, so this picture is taken live (see the
    module docstring) and no test compares it.
    """
    from lm_console.client.remote import RemoteConsoleClient
    from lm_console.engine.metrics.stats import BLOCK_STATE_CACHED
    from lm_console.tui.app import ConsoleApp
    from lm_console.tui.widgets.kv_event_log import KVEventLog

    client = RemoteConsoleClient(url, kv_events_endpoint=kv_events_endpoint, poll_interval_s=0.5)
    app = ConsoleApp(client, tick_hz=4)
    bench = subprocess.Popen(
        [sys.executable, "-m", "lm_console.cli", "bench", "serve", "--url", url, "--dataset-name", "prefix",
         "--num-prompts", "60", "--prefix-len", "256", "--suffix-len", "200", "--num-prefixes", "3",
         "--random-output-len", "16", "--max-concurrency", "4", "--request-rate", "3", "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async with app.run_test(size=SIZE) as pilot:
            log = app.query_one(KVEventLog)
            deadline = time.monotonic() + 600
            while not (log.num_received >= 12 and app.telemetry.view.num_finished >= 8 and app.telemetry.view.block_states
                       and app.telemetry.view.block_states.count(BLOCK_STATE_CACHED) > 0):
                if app.dead_error is not None or time.monotonic() > deadline or bench.poll() is not None:
                    raise SystemExit(f"the console saw too little of the server's load (dead: {app.dead_error!r})")
                await pilot.pause(0.25)
            await pilot.pause(1.0)
            app.save_screenshot("vllm_dashboard.svg", str(out_dir))
            await pilot.press("q")
    finally:
        bench.kill()
        bench.wait()
    return out_dir / "vllm_dashboard.svg"


def svg_text(path: Path) -> list[str]:
    """The screen's text, row by row, from a Textual SVG screenshot."""
    import html
    import re

    rows: dict[float, list[tuple[float, str]]] = {}
    for match in re.finditer(r'<text class="[^"]*" x="([\d.]+)" y="([\d.]+)"[^>]*>(.*?)</text>', path.read_text()):
        x, y, text = float(match.group(1)), float(match.group(2)), html.unescape(match.group(3))
        rows.setdefault(y, []).append((x, text.replace("\xa0", " ")))
    return ["".join(text for _, text in sorted(cells)).rstrip() for _, cells in sorted(rows.items())]


def to_png(svg: Path, png: Path, width: int = 1600) -> bool:
    """Convert with cairosvg, else rsvg-convert; False when neither is available."""
    text = svg.read_text().replace("font-family: Fira Code, monospace;", f'font-family: "{PNG_FONT}", monospace;')
    with tempfile.NamedTemporaryFile("w", suffix=".svg", delete=False) as tmp:
        tmp.write(text)
    try:
        try:
            import cairosvg

            cairosvg.svg2png(url=tmp.name, write_to=str(png), output_width=width)
            return True
        except ImportError:
            if shutil.which("rsvg-convert"):
                subprocess.run(["rsvg-convert", "-w", str(width), "-o", str(png), tmp.name], check=True)
                return True
            return False
    finally:
        os.unlink(tmp.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scene", action="append", choices=sorted(SCENES), help="only these scenes")
    parser.add_argument("--replay", action="store_true", help="re-render from scenes/*.json (no engine)")
    parser.add_argument("--no-png", action="store_true")
    parser.add_argument("--vllm", metavar="URL", help="only the console on this running vLLM server (live, under load)")
    parser.add_argument("--kv-events-endpoint", default="tcp://127.0.0.1:5557", help="with --vllm: its KV events")
    args = parser.parse_args()
    time.tzset()
    if args.vllm:
        svg = asyncio.run(vllm_shot(args.vllm, args.kv_events_endpoint, HERE))
        made = [svg.name] + ([svg.with_suffix(".png").name] if not args.no_png and to_png(svg, svg.with_suffix(".png"))
                             else [])
        print(f"vllm: {', '.join(made)}")
        return
    os.chdir(HERE.parent)  # the image's path as `lmc chat --image` shows it: relative to the repository
    if not IMAGE.exists():
        make_picture(IMAGE)
    for name in args.scene or list(SCENES):
        start = time.monotonic()
        saved = asyncio.run(run_scene(name, HERE, args.replay))
        made = [svg.name for svg in saved]
        if not args.no_png:
            for svg in saved:
                if to_png(svg, svg.with_suffix(".png")):
                    made.append(svg.with_suffix(".png").name)
                else:
                    print("  (no PNG: install cairosvg or rsvg-convert)")
                    break
        print(f"{name}: {', '.join(made)} ({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
