"""`--url`, `--api-key` and `--kv-events-endpoint`: attach a console command to a running server."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

UrlOpt = Annotated[Optional[str], typer.Option(
    "--url", help="Attach to a running OpenAI-compatible server (http://HOST:PORT) instead of starting an engine: "
                  "an lm-console server in full, any other (vLLM) through /metrics and --kv-events-endpoint.")]
ApiKeyOpt = Annotated[Optional[str], typer.Option(
    "--api-key", envvar="LMC_API_KEY", show_envvar=True, help="The server's API key (sent as Authorization: Bearer).")]
KVEventsEndpointOpt = Annotated[Optional[str], typer.Option(
    "--kv-events-endpoint", help="With --url: the server's ZMQ PUB socket of KV events (tcp://HOST:PORT), for "
                                 "servers whose KV events do not come over HTTP (vLLM's --kv-events-config).")]


def check_remote_flags(url: str | None, model: str | None = None, fake: bool = False,
                       kv_events_endpoint: str | None = None) -> None:
    """Refuse flag combinations that cannot mean anything."""
    if url is None:
        if kv_events_endpoint is not None:
            raise typer.BadParameter("--kv-events-endpoint goes with --url (a local engine's events need no address).")
        return
    if not url.startswith(("http://", "https://")):
        raise typer.BadParameter(f"--url must look like http://HOST:PORT, got {url!r}")
    if fake or model is not None:
        raise typer.BadParameter("--url attaches to a running server; --model and --fake start a local engine. "
                                 "Pass one or the other.")


def remote_client(url: str, api_key: str | None, kv_events_endpoint: str | None = None):  # noqa: ANN201
    """The ConsoleClient of a running server (imports httpx only)."""
    from lm_console.client.remote import RemoteConsoleClient

    return RemoteConsoleClient(url, api_key=api_key, kv_events_endpoint=kv_events_endpoint)
