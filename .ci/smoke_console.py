"""Packaging smoke test of an installed lm-console (run by .ci/package_check.sh in a fresh venv).

Runs `lmc tui --fake --load` through the real command line with the app driven headless by a
Pilot (so app.tcss must load from the installed package), checks `lmc --version` and `lmc tui
--help`, and, with --no-torch (the console-only venv), that none of it imported torch.
Run it from outside the checkout so that `import lm_console` finds the installed copy.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

from typer.testing import CliRunner

import lm_console
from lm_console.engine.version import __version__
from lm_console import cli_console
from lm_console.cli import app

HEAVY = ("torch", "transformers", "triton")
STEPS = 600  # pauses of 50 ms at most: the fake engine finishes requests within a second or two


def check_installed() -> None:
    """The package under test is the installed one, not a checkout on sys.path."""
    where = Path(lm_console.__file__).resolve()
    assert Path(sys.prefix).resolve() in where.parents, f"lm_console imported from {where}, not {sys.prefix}"
    print(f"lm_console from {where.parent}")


async def drive(console) -> None:  # noqa: ANN001 - ConsoleApp
    """Run the app headless until the fake engine serves and the load has finished requests."""
    async with console.run_test(size=(120, 36)) as pilot:
        for _ in range(STEPS):
            await pilot.pause(0.05)
            if console.engine_state == "dead":
                raise AssertionError(f"the fake engine died: {console.dead_error}")
            if console.engine_state == "serving" and console.book.num_finished >= 3:
                break
        assert console.engine_state == "serving", console.engine_state
        assert console.book.num_finished >= 3, f"only {console.book.num_finished} requests finished"
        print(f"lmc tui --fake: serving, {console.book.num_finished} requests finished, "
              f"stylesheet {console.css_path[0]}")
        await pilot.press("q")


def run_tui_headless() -> None:
    """`lmc tui --fake --load` through Typer, the app run by a Pilot instead of a terminal."""
    apps = []

    def headless(console) -> None:  # noqa: ANN001
        apps.append(console)
        asyncio.run(drive(console))

    cli_console.run_app = headless  # the command's own path up to the app; only the driver differs
    result = CliRunner().invoke(app, ["tui", "--fake", "--load", "--rate", "8"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert len(apps) == 1


def main() -> None:
    no_torch = "--no-torch" in sys.argv
    check_installed()
    runner = CliRunner()
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"lm-console {__version__}", result.output
    result = runner.invoke(app, ["tui", "--help"])
    assert result.exit_code == 0 and "--fake" in result.output, result.output
    # `lmc tui --url` and friends: the remote console and what it imports while it attaches.
    for remote in ("lm_console.client.remote", "lm_console.client.vllm_metrics", "lm_console.batch_remote",
                   "lm_console.bench.http"):
        importlib.import_module(remote)
    result = runner.invoke(app, ["tui", "--url", "http://127.0.0.1:9", "--help"])
    assert result.exit_code == 0, result.output
    run_tui_headless()
    heavy = [name for name in HEAVY if name in sys.modules]
    if no_torch:
        assert not heavy, f"the console imported {heavy}"
        assert importlib.util.find_spec("torch") is None, "torch is installed in the console-only venv"
        print("console-only: torch is neither installed nor imported")
    print("console smoke test passed")


if __name__ == "__main__":
    main()
