"""`--url`, `--api-key` and `--kv-events-endpoint`: attach a console command to a running server."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lm_console.engine import envs

UrlOpt = Annotated[Optional[str], typer.Option(
    "--url", help="Attach to a running OpenAI-compatible server (http://HOST:PORT) instead of starting an engine: "
                  "an lm-console server in full, any other (vLLM) through /metrics and --kv-events-endpoint.")]
ApiKeyOpt = Annotated[Optional[str], typer.Option(
    "--api-key", envvar=envs.LMC_API_KEY.name, show_envvar=True, help="The server's API key (sent as Authorization: Bearer).")]
KVEventsEndpointOpt = Annotated[Optional[str], typer.Option(
    "--kv-events-endpoint", help="With --url: the server's ZMQ PUB socket of KV events (tcp://HOST:PORT), for "
                                 "servers whose KV events do not come over HTTP (vLLM's --kv-events-config).")]


# Flags that configure an engine of the console's own: with --url they would mean nothing (every
# engine flag, engine_options.engine_flag_params(), and these).
LOCAL_FLAGS = frozenset({
    "model", "fake", "kv_transfer_config", "kv_offload", "kv_offload_disk", "kv_offload_cpu_bytes",
    "kv_offload_disk_bytes", "kv_chunk_size", "endpoint", "speculative_config",
})


def local_engine_flags() -> frozenset[str]:
    """The command parameters that configure a local engine."""
    from lm_console.engine_options import engine_flag_params

    return LOCAL_FLAGS | engine_flag_params()


def refuse_local_flags(ctx: typer.Context, url: str | None, allowed: frozenset[str] = frozenset()) -> None:
    """With --url, refuse engine flags given on the command line (they would be silently ignored)."""
    if url is None:
        return
    # By name: Typer may carry its own copy of click's ParameterSource enum.
    local = local_engine_flags() - allowed
    given = sorted(name for name in ctx.params if name in local
                   and getattr(ctx.get_parameter_source(name), "name", "") in ("COMMANDLINE", "ENVIRONMENT"))
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise typer.BadParameter(f"{flags} configure(s) an engine of this console's own; with --url the server's "
                                 "engine is used as it is. Drop them, or drop --url.")


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
