"""Scripted, deterministic scenes for snapshot tests and screenshots (fake engine, fixed clock)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from lm_console.client.fake import FakeConsoleClient
from lm_console.load_generator import LoadShape
from lm_console.tui.app import ConsoleApp
from lm_console.tui.widgets.prompt_input import PromptInput


class ManualClock:
    """A clock that only moves when told to."""

    def __init__(self, start: float = 1_767_268_800.0) -> None:  # 2026-01-01 12:00:00 UTC
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def demo_app(chat_only: bool = False, num_blocks: int = 256, token_budget: int = 192,
             max_num_seqs: int = 32) -> tuple[ConsoleApp, FakeConsoleClient, ManualClock]:
    """A console over a fake engine that steps only when the scene says so."""
    clock = ManualClock()
    client = FakeConsoleClient(auto_step=False, clock=clock, num_blocks=num_blocks,
                               token_budget=token_budget, max_num_seqs=max_num_seqs)
    shape = LoadShape(rate=4.0, prompt_len=(48, 224), output_len=(24, 120), shared_prefix_share=0.5,
                      prefix_len=96)
    app = ConsoleApp(client, shape=shape, chat_only=chat_only, clock=clock, tick_hz=0)
    return app, client, clock


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def drive_load(app: ConsoleApp, client: FakeConsoleClient, clock: ManualClock, num_steps: int = 160,
                     submit_every: int = 3, step_s: float = 0.05, on_tick: Callable[[], None] | None = None) -> None:
    """Submit load requests and step the fake engine; the UI ticks every 4 steps (like 5 Hz)."""
    while app.load is None:
        await asyncio.sleep(0.01)
    app.load.running = True  # shown as ON; arrivals are scripted below, not timed
    for step in range(num_steps):
        if step % submit_every == 0:
            app.load.submit_one()
        await _settle()
        client.step()
        await _settle()
        clock.advance(step_s)
        if step % 4 == 3:
            app.tick()
            if on_tick is not None:
                on_tick()
    app.tick()


async def drive_chat(app: ConsoleApp, client: FakeConsoleClient, clock: ManualClock, text: str) -> None:
    """Send one chat message and step until the fake reply has streamed completely."""
    while app.load is None:
        await asyncio.sleep(0.01)
    prompt = app.query_one(PromptInput)
    prompt.cursor_blink = False
    prompt.post_message(PromptInput.Submitted(text))
    await _settle()
    for _ in range(200):
        await _settle()
        if not client.has_unfinished_requests() and app.session.current_request_id is None:
            break
        client.step()
        clock.advance(0.04)
        await _settle()
    await asyncio.sleep(0.05)
    app.tick()
