"""Regenerate the console screenshots (SVG, and PNG for the README) from scripted scenes.

    .venv/bin/python screenshots/make_screenshots.py [--size 120x36] [--no-png]

The scenes run the real app over the fake engine with a fixed clock (lm_console/tui/demo.py), so
the pictures are reproducible. PNGs need cairosvg (`pip install -e '.[screenshots]'`) or
rsvg-convert; the SVG's font is swapped for an installed monospace one before converting.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from lm_console.tui.demo import demo_app, drive_chat, drive_load

HERE = Path(__file__).resolve().parent
PNG_FONT = "DejaVu Sans Mono"


async def shoot_dashboard(size: tuple[int, int], path: Path) -> None:
    app, client, clock = demo_app()
    async with app.run_test(size=size) as pilot:
        await drive_load(app, client, clock, num_steps=160)
        await pilot.pause()
        app.save_screenshot(path.name, str(path.parent))


async def shoot_chat(size: tuple[int, int], path: Path) -> None:
    app, client, clock = demo_app()
    async with app.run_test(size=size) as pilot:
        app.action_show_tab("chat")
        await drive_chat(app, client, clock, "What does a paged KV cache buy me?")
        await pilot.pause()
        app.save_screenshot(path.name, str(path.parent))


async def shoot_help(size: tuple[int, int], path: Path) -> None:
    app, _, _ = demo_app()
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        await pilot.press("question_mark")
        await pilot.pause()
        app.save_screenshot(path.name, str(path.parent))


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
    parser.add_argument("--size", default="120x36", help="terminal size, COLSxROWS")
    parser.add_argument("--no-png", action="store_true")
    args = parser.parse_args()
    size = tuple(int(x) for x in args.size.split("x"))
    os.environ["TZ"] = "UTC"  # the event log prints times of day
    os.environ["PYTHONHASHSEED"] = "0"  # the root of the block hashes it shows (else random)
    time.tzset()
    scenes = {"dashboard": shoot_dashboard, "chat": shoot_chat, "help": shoot_help}
    for name, scene in scenes.items():
        svg = HERE / f"{name}.svg"
        asyncio.run(scene(size, svg))  # type: ignore[arg-type]
        made = [svg.name]
        if not args.no_png:
            if to_png(svg, svg.with_suffix(".png")):
                made.append(svg.with_suffix(".png").name)
            else:
                print("  (no PNG: install cairosvg or rsvg-convert)")
        print(f"{name}: {', '.join(made)}")


if __name__ == "__main__":
    main()
