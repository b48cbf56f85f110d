"""Snapshot tests (pytest-textual-snapshot) of the dashboard under load, the chat and the help."""

from __future__ import annotations

import time

import pytest

from lm_console.tui.demo import demo_app, drive_chat, drive_load

pytestmark = pytest.mark.slow

SIZE = (120, 36)


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """Event timestamps print in local time: pin it. Block hashes start from a random root
    unless PYTHONHASHSEED is set (lm_console/engine/kv_cache_hashing.py): pin that too."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_dashboard_under_load(snap_compare) -> None:  # noqa: ANN001
    app, client, clock = demo_app()

    async def run_before(pilot) -> None:  # noqa: ANN001
        await drive_load(app, client, clock, num_steps=120)
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_chat(snap_compare) -> None:  # noqa: ANN001
    app, client, clock = demo_app()

    async def run_before(pilot) -> None:  # noqa: ANN001
        app.action_show_tab("chat")
        await drive_chat(app, client, clock, "What does a paged KV cache buy me?")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_help(snap_compare) -> None:  # noqa: ANN001
    app, _, _ = demo_app()
    assert snap_compare(app, terminal_size=SIZE, press=["question_mark"])
