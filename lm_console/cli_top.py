"""`lmc top`: the fleet's rows on stdout, for scripts and CI (`--once`, `--json`).

`--once` reads every server's /metrics twice, --interval apart (rates need two readings), prints
one snapshot and exits 1 while any alert fires (a server down included), 0 otherwise, 2 on a bad
fleet file. Its latency quantiles and prefix hit rate are since each server started; its rates
are over the interval. Without --once it prints a snapshot every --interval until interrupted.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from lm_console.remote_options import ApiKeyOpt

UrlsOpt = Annotated[Optional[list[str]], typer.Option(
    "--url", help="A server to watch (http://HOST:PORT, or NAME=http://HOST:PORT); repeatable.")]
FleetOpt = Annotated[Optional[Path], typer.Option(
    "--fleet", help="A fleet file (TOML: [[server]] tables with name and url, [alerts] thresholds); default "
                    "~/.config/lm-console/fleet.toml when no --url is given.",
    dir_okay=False)]


def top(
    url: UrlsOpt = None, fleet: FleetOpt = None, api_key: ApiKeyOpt = None,
    once: Annotated[bool, typer.Option("--once", help="One snapshot, then exit: 1 while an alert fires, else 0.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (one object per snapshot) instead of a table.")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between the two readings of --once, or between "
                                                 "snapshots.", min=0.1)] = 1.0,
) -> None:
    """The fleet's figures and alerts from each server's /metrics, for scripts and CI."""
    from lm_console.fleet.config import FleetConfigError, default_fleet_path, fleet_config

    try:
        config = fleet_config(url, fleet, api_key, default_path=default_fleet_path())
    except FleetConfigError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    try:
        code = asyncio.run(_run(config, once, as_json, interval))
    except KeyboardInterrupt:
        code = 130
    raise typer.Exit(code)


async def _run(config, once: bool, as_json: bool, interval: float) -> int:  # noqa: ANN001 - FleetConfig
    from lm_console.fleet.monitor import Fleet

    if once:
        # Quantiles since each server's start: two readings a second apart hold too few requests.
        config.latency_window_s = None
        config.rate_window_s = max(config.rate_window_s, interval * 2)
        config.thresholds.down_after_failures = min(config.thresholds.down_after_failures, 2)
    fleet = Fleet(config)
    try:
        await fleet.poll()
        while True:
            await asyncio.sleep(interval)
            await fleet.poll()
            _print(fleet, as_json)
            if once:
                return 1 if fleet.alerts.num_firing else 0
    finally:
        await fleet.close()


def snapshot(fleet) -> dict[str, object]:  # noqa: ANN001 - Fleet
    """The JSON document of one snapshot."""
    return {
        "time": time.time(),
        "servers": [row.as_dict() for row in fleet.rows()],
        "alerts": [{"server": server, "kind": kind, "detail": fleet.alerts.firing[server][kind][1],
                    "since": fleet.alerts.firing[server][kind][0]} for server, kind in fleet.alerts.summary()],
        "thresholds": fleet.config.thresholds.as_dict(),
    }


def _print(fleet, as_json: bool) -> None:  # noqa: ANN001 - Fleet
    if as_json:
        sys.stdout.write(json.dumps(snapshot(fleet)) + "\n")
        sys.stdout.flush()
        return
    from rich.console import Console
    from rich.table import Table

    from lm_console.fleet.render import COLUMNS, row_cells

    table = Table(*COLUMNS, title=time.strftime("%H:%M:%S"), title_justify="left", box=None)
    for row in fleet.rows():
        table.add_row(*row_cells(row), style="red" if row.alerts else None)
    console = Console(width=200)
    console.print(table)
    for server, kind in fleet.alerts.summary():
        console.print(f"ALERT {server} {kind}: {fleet.alerts.firing[server][kind][1]}", style="red", markup=False)
