"""The README's screenshots are what the app renders now: each scene's recording (what the real
engine gave the console, screenshots/scenes/*.json) is replayed through today's app and the text of
every SVG it saves must equal the committed SVG's. After a change to the console's looks:
`python screenshots/make_screenshots.py --replay` (seconds), or without --replay to rerun the engine."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from script_helpers import load_script

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = REPO / "screenshots"


def make_screenshots():  # noqa: ANN201
    return load_script(SCREENSHOTS / "make_screenshots.py")


@pytest.fixture
def scene_env(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    monkeypatch.chdir(REPO)  # the attached image's path is shown relative to the repository
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.parametrize("scene", ["dashboard", "chat", "image_chat"])
def test_committed_screenshots_match_what_the_app_renders(scene: str, tmp_path: Path, scene_env) -> None:  # noqa: ANN001
    module = make_screenshots()
    assert (SCREENSHOTS / "scenes" / f"{scene}.json").is_file(), "run screenshots/make_screenshots.py"
    saved = asyncio.run(module.run_scene(scene, tmp_path, replay=True))
    assert saved
    for svg in saved:
        committed = SCREENSHOTS / svg.name
        assert committed.is_file(), f"{svg.name} is not committed: run screenshots/make_screenshots.py --replay"
        now, then = module.svg_text(svg), module.svg_text(committed)
        differing = [f"row {i}:\n  committed: {a!r}\n  app now:   {b!r}"
                     for i, (a, b) in enumerate(zip(then, now)) if a != b]
        assert now == then, (f"screenshots/{svg.name} is stale (python screenshots/make_screenshots.py --replay):\n"
                             + "\n".join(differing[:5]))
