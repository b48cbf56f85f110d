"""Run `lmc tui ARGS` the way `make run` does, but under Textual's Pilot instead of a terminal.

Used by test_first_run.py in a fresh subprocess: the real `lmc` entry point (lm_console.cli.main),
the real import order, the console's own engine start. Only the last step differs: run_app drives
the app headless, waits for the dashboard to serve with the built-in load finishing requests,
asks the chat one question, and prints what it saw as one JSON line.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
from typing import Any

DEADLINE_S = 600  # a liveness bound (an empty cache converts the model and compiles the kernels)


def drive(app: Any) -> None:
    from lm_console.client.types import GenParams
    from lm_console.tui.widgets.chat_message import ChatMessage
    from lm_console.tui.widgets.prompt_input import PromptInput

    async def until(pilot: Any, condition: Any, what: str) -> None:
        end = time.monotonic() + DEADLINE_S
        while not condition():
            if app.dead_error is not None:
                raise SystemExit(f"the engine died: {app.dead_error!r} (log: {app.log_path})")
            if time.monotonic() > end:
                raise SystemExit(f"the console never showed {what} (state {app.engine_state})")
            await pilot.pause(0.1)

    async def scenario() -> dict[str, Any]:
        started = time.monotonic()
        async with app.run_test(size=(120, 36)) as pilot:
            await until(pilot, lambda: app.engine_state == "serving", "the engine serving")
            serving_s = time.monotonic() - started
            await until(pilot, lambda: app.load is not None and app.load.running and app.book.num_finished >= 2,
                        "two finished requests of the built-in load")
            app.action_show_tab("chat")
            app.session.params = GenParams(temperature=0.0, max_tokens=8)
            app.query_one(PromptInput).post_message(PromptInput.Submitted("What is the capital of France?"))
            await until(pilot, lambda: app.session.last_stats is not None and app.session.current_request_id is None
                        and app.query_one("#chat").streaming is None, "the chat's reply")
            reply = [m for m in app.query(ChatMessage) if m.role == "assistant"][-1].text
            result = {"serving_after_s": round(serving_s, 1), "load_finished": app.book.num_finished,
                      "reply": reply, "log_path": str(app.log_path), "engine_state": app.engine_state,
                      "top_level_kernels": getattr(importlib.util.find_spec("kernels"), "origin", None)}
            await app.action_quit()  # the console's own clean quit (q): load stopped, engine shut down
        return result

    print("FIRST-RUN " + json.dumps(asyncio.run(scenario())), flush=True)


def main(argv: list[str]) -> None:
    from lm_console import cli, cli_console

    cli_console.run_app = drive  # the one difference from `lmc tui`: Pilot instead of a terminal
    sys.argv = ["lmc", *argv]
    cli.main()


if __name__ == "__main__":
    main(sys.argv[1:])
