"""The fleet file (TOML) and the command line's `--url` list, as one FleetConfig.

```toml
poll_interval_s = 1.0          # how often each server's /metrics is read
rate_window_s = 10             # throughput, preemptions/s and errors/s are over this window
latency_window_s = 60          # TTFT / ITL / queue-time quantiles and the prefix hit rate: this one

[[server]]
name = "replica-a"
url = "http://10.0.0.5:8000"
api_key_env = "REPLICA_A_KEY"  # or api_key = "..." (the environment is the better place)

[alerts]                       # any subset; the rest keep their defaults (alerts.Thresholds)
kv_usage = 0.9
decode_stall_s = 5
```

Without --fleet and --url, `lmc top` reads $XDG_CONFIG_HOME/lm-console/fleet.toml
(~/.config/lm-console/fleet.toml).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from lm_console.fleet.alerts import Thresholds

from lm_console.engine import envs

TOP_KEYS = {"poll_interval_s", "rate_window_s", "latency_window_s", "server", "alerts"}
SERVER_KEYS = {"name", "url", "api_key", "api_key_env"}


class FleetConfigError(ValueError):
    """The fleet file or the --url list cannot be used; the message says where and why."""


@dataclass(slots=True)
class ServerSpec:
    name: str
    url: str
    api_key: str | None = None


@dataclass(slots=True)
class FleetConfig:
    servers: list[ServerSpec]
    thresholds: Thresholds = field(default_factory=Thresholds)
    poll_interval_s: float = 1.0
    rate_window_s: float = 10.0
    latency_window_s: float | None = 60.0  # None: since each server started (lmc top --once)
    source: str = "--url"  # where it came from, for messages


def default_fleet_path() -> Path:
    base = envs.XDG_CONFIG_HOME.get() or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "lm-console" / "fleet.toml"


def _check_url(url: str, where: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise FleetConfigError(f"{where}: a server URL looks like http://HOST:PORT, got {url!r}")
    return url.rstrip("/")


def server_from_arg(arg: str, api_key: str | None) -> ServerSpec:
    """`--url http://h:p` (named h:p) or `--url name=http://h:p`."""
    name, sep, url = arg.partition("=")
    if not sep or "://" in name:
        name, url = "", arg
    url = _check_url(url, "--url")
    return ServerSpec(name=name or urlsplit(url).netloc, url=url, api_key=api_key)


def _number(table: dict[str, Any], key: str, default: float, where: str) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise FleetConfigError(f"{where}: {key} must be a number > 0, got {value!r}")
    return float(value)


def parse_fleet(data: dict[str, Any], where: str) -> FleetConfig:
    """A FleetConfig from the parsed TOML; FleetConfigError naming the key that is wrong."""
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise FleetConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} "
                               f"(known: {', '.join(sorted(TOP_KEYS))})")
    servers: list[ServerSpec] = []
    entries = data.get("server", [])
    if not isinstance(entries, list):
        raise FleetConfigError(f"{where}: servers are [[server]] tables")
    for i, entry in enumerate(entries):
        at = f"{where}: [[server]] #{i + 1}"
        if not isinstance(entry, dict) or "url" not in entry:
            raise FleetConfigError(f"{at} needs a url")
        extra = set(entry) - SERVER_KEYS
        if extra:
            raise FleetConfigError(f"{at}: unknown key(s) {', '.join(sorted(extra))}")
        url = _check_url(str(entry["url"]), at)
        key = entry.get("api_key")
        if entry.get("api_key_env"):
            key = envs.read_named(str(entry["api_key_env"])) or key
        servers.append(ServerSpec(name=str(entry.get("name") or urlsplit(url).netloc), url=url,
                                  api_key=str(key) if key else None))
    alerts = data.get("alerts", {})
    if not isinstance(alerts, dict):
        raise FleetConfigError(f"{where}: [alerts] is a table")
    try:
        thresholds = Thresholds.from_table(alerts, f"{where}: [alerts]")
    except ValueError as error:
        raise FleetConfigError(str(error)) from error
    return FleetConfig(servers=servers, thresholds=thresholds, source=where,
                       poll_interval_s=_number(data, "poll_interval_s", 1.0, where),
                       rate_window_s=_number(data, "rate_window_s", 10.0, where),
                       latency_window_s=_number(data, "latency_window_s", 60.0, where))


def load_fleet(path: Path) -> FleetConfig:
    """Read a fleet file; FleetConfigError when it is missing or malformed."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError as error:
            raise FleetConfigError("fleet files need Python 3.11+ (or `pip install tomli`)") from error
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise FleetConfigError(f"cannot read the fleet file {path}: {error.strerror or error}") from error
    except tomllib.TOMLDecodeError as error:
        raise FleetConfigError(f"{path} is not valid TOML: {error}") from error
    return parse_fleet(data, str(path))


def fleet_config(urls: list[str] | None, fleet_file: Path | None, api_key: str | None,
                 default_path: Path | None = None) -> FleetConfig:
    """The servers of --fleet FILE (or the default file when given and neither flag is) plus --url's.

    --api-key applies to the --url servers (a fleet file names each server's own key).
    """
    config: FleetConfig | None = None
    if fleet_file is not None:
        config = load_fleet(fleet_file)
    elif not urls and default_path is not None:
        if not default_path.exists():
            raise FleetConfigError(f"no servers: pass --url URL (repeatable) or --fleet FILE, or write {default_path}")
        config = load_fleet(default_path)
    if config is None:
        config = FleetConfig(servers=[])
    config.servers += [server_from_arg(url, api_key) for url in urls or []]
    if not config.servers:
        raise FleetConfigError(f"{config.source}: no servers ([[server]] tables with a url)")
    names = [s.name for s in config.servers]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise FleetConfigError(f"two servers are named {duplicate!r}: give them names (name=URL, or name = ... )")
    return config
