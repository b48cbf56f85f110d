"""`lmc tui`, `lmc chat` and `lmc events`: thin commands that build a client and run the console."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from lm_console.engine_options import (
    FakeOpt, ModelOpt, SpeculativeConfigOpt, console_threads, engine_flags, parse_range, speculative_args,
)
from lm_console.extras import require
from lm_console.kv_options import (
    KVChunkSizeOpt, KVOffloadCpuBytesOpt, KVOffloadDiskBytesOpt, KVOffloadDiskOpt, KVOffloadOpt, KVTransferConfigOpt,
    kv_transfer_args,
)
from lm_console.remote_options import (
    ApiKeyOpt, KVEventsEndpointOpt, UrlOpt, check_remote_flags, refuse_local_flags, remote_client,
)

RateOpt = Annotated[float, typer.Option(help="Load: requests per second (Poisson arrivals).")]
PromptLenOpt = Annotated[str, typer.Option(help="Load: prompt tokens, min-max.")]
OutputLenOpt = Annotated[str, typer.Option(help="Load: output tokens, min-max.")]
SharedOpt = Annotated[float, typer.Option(help="Load: share of requests that start with a shared prefix (0-1).")]
PrefixLenOpt = Annotated[int, typer.Option(help="Load: tokens in each shared prefix.")]


def make_client(fake: bool, model: str | None, args: dict, url: str | None = None,  # noqa: ANN201
                api_key: str | None = None, kv_events_endpoint: str | None = None, command: str = "lmc tui"):
    """A running server's client (--url), the fake engine, or AsyncLLM over `model` (imported when it starts)."""
    from lm_console.client import AsyncLLMConsoleClient, FakeConsoleClient

    check_remote_flags(url, model, fake, kv_events_endpoint)
    if url is not None:
        return remote_client(url, api_key, kv_events_endpoint)
    if fake:
        given = [flag for flag, key, default in (("--scheduling-policy", "scheduling_policy", "fcfs"),
                                                 ("--kv-cache-metrics", "kv_cache_metrics", False))
                 if args.get(key, default) != default]
        if given:
            raise typer.BadParameter(f"{', '.join(given)} configure(s) the real engine; the fake engine (--fake) "
                                     "has no such option. Drop them, or drop --fake.")
        return FakeConsoleClient(num_blocks=args.get("num_gpu_blocks_override") or 512,
                                 block_size=args.get("block_size", 16),
                                 max_num_seqs=min(args.get("max_num_seqs", 16), 32),
                                 max_model_len=args.get("max_model_len"),
                                 data_parallel_size=args.get("data_parallel_size", 1))
    require(command, "engine")  # here, before the engine would fail inside the app or its process
    return AsyncLLMConsoleClient(model, **args)


def default_log_path():  # noqa: ANN201 - Path
    from lm_console.tui.stderr_capture import default_log_path as path

    return path()


def run_app(app) -> None:  # noqa: ANN001 - ConsoleApp
    """Run the app with the engine's stderr going to its log file instead of the screen."""
    from lm_console.tui.stderr_capture import stderr_to_log

    with stderr_to_log(app.log_path):
        app.run()
    if app.dead_error is not None:
        typer.echo(f"error: {app.dead_error} (engine log: {app.log_path})", err=True)
        raise typer.Exit(1)


def make_shape(rate: float, prompt_len: str, output_len: str, shared_prefix: float, prefix_len: int):  # noqa: ANN201
    from lm_console.load_generator import LoadShape

    return LoadShape(rate=rate, prompt_len=parse_range(prompt_len, "--prompt-len"),
                     output_len=parse_range(output_len, "--output-len"),
                     shared_prefix_share=min(max(shared_prefix, 0.0), 1.0), prefix_len=max(prefix_len, 1))


TuiUrlsOpt = Annotated[Optional[list[str]], typer.Option(
    "--url", help="Attach to a running OpenAI-compatible server (http://HOST:PORT) instead of starting an engine: "
                  "an lm-console server in full, any other (vLLM) through /metrics and --kv-events-endpoint. "
                  "Repeat it (NAME=URL names a server) for the fleet view of several servers.")]
FleetFileOpt = Annotated[Optional[Path], typer.Option(
    "--fleet", help="A fleet file (TOML: [[server]] tables with name and url, [alerts] thresholds): the fleet view "
                    "of its servers (and of any --url).", dir_okay=False)]


@engine_flags()
def tui(
    ctx: typer.Context,
    engine_kwargs: dict[str, Any],
    model: ModelOpt = None,
    load: Annotated[bool, typer.Option("--load/--no-load", help="Start the built-in load generator at once.")] = False,
    rate: RateOpt = 1.0, prompt_len: PromptLenOpt = "32-192", output_len: OutputLenOpt = "16-96",
    shared_prefix: SharedOpt = 0.5, prefix_len: PrefixLenOpt = 96, fake: FakeOpt = False,
    kv_transfer_config: KVTransferConfigOpt = None, kv_offload: KVOffloadOpt = False,
    kv_offload_disk: KVOffloadDiskOpt = None, kv_offload_cpu_bytes: KVOffloadCpuBytesOpt = 2 << 30,
    kv_offload_disk_bytes: KVOffloadDiskBytesOpt = 16 << 30, kv_chunk_size: KVChunkSizeOpt = 256,
    url: TuiUrlsOpt = None, fleet: FleetFileOpt = None, api_key: ApiKeyOpt = None,
    kv_events_endpoint: KVEventsEndpointOpt = None,
    speculative_config: SpeculativeConfigOpt = None,
) -> None:
    """The operator console: a live dashboard and a chat, of its own engine, of a server (--url), or of
    a fleet of servers (--url repeated, or --fleet FILE)."""
    urls = list(url or [])
    if fleet is not None or len(urls) > 1:
        refuse_local_flags(ctx, "fleet")  # as with --url: engine flags would configure nothing
        _run_fleet(urls, fleet, api_key, kv_events_endpoint, model, fake)
        return
    single = urls[0] if urls else None
    refuse_local_flags(ctx, single)
    from lm_console.tui.app import ConsoleApp

    args = {**engine_kwargs, "num_threads": console_threads(engine_kwargs.get("num_threads"))}
    args.update(kv_transfer_args(kv_transfer_config, kv_offload, kv_offload_disk, kv_offload_cpu_bytes,
                                 kv_offload_disk_bytes, kv_chunk_size))
    args.update(speculative_args(speculative_config))
    shape = make_shape(rate, prompt_len, output_len, shared_prefix, prefix_len)
    client = make_client(fake, model, args, single, api_key, kv_events_endpoint)
    run_app(ConsoleApp(client, load=load, shape=shape, log_path=default_log_path()))


def _run_fleet(urls: list[str], fleet: Path | None, api_key: str | None, kv_events_endpoint: str | None,
               model: str | None, fake: bool) -> None:
    """`lmc tui` over several servers: the fleet tab, and the dashboard of one server at a time."""
    from lm_console.fleet.config import FleetConfigError, fleet_config

    if model is not None or fake or kv_events_endpoint is not None:
        raise typer.BadParameter("the fleet view watches running servers: --model, --fake and --kv-events-endpoint "
                                 "go with a single --url (or none).")
    try:
        config = fleet_config(urls, fleet, api_key)
    except FleetConfigError as error:
        raise typer.BadParameter(str(error)) from None
    from lm_console.tui.fleet_app import FleetConsoleApp
    from lm_console.tui.stderr_capture import stderr_to_log

    log_path = default_log_path()
    app = FleetConsoleApp(config, log_path=log_path)
    with stderr_to_log(log_path):
        app.run()


# One person chats: a small batch leaves the console's memory small.
@engine_flags({"max_num_seqs": 16})
def chat(
    ctx: typer.Context,
    engine_kwargs: dict[str, Any],
    model: ModelOpt = None,
    plain: Annotated[bool, typer.Option("--plain", help="Line-based REPL: stdin lines in, replies on stdout.")] = False,
    system: Annotated[Optional[str], typer.Option(help="System prompt ('' for none).")] = None,
    temperature: Annotated[float, typer.Option(help="0 means greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option()] = 0.95,
    max_tokens: Annotated[int, typer.Option(help="Most tokens in one reply.")] = 256,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed (reproducible replies).")] = None,
    stats: Annotated[bool, typer.Option("--stats", help="--plain: print each reply's stats to stderr.")] = False,
    image: Annotated[Optional[list[str]], typer.Option(
        "--image", help="Attach an image file to the first message (repeatable; needs a VLM, e.g. "
                        "--model demo-vlm).")] = None,
    fake: FakeOpt = False, url: UrlOpt = None, api_key: ApiKeyOpt = None,
) -> None:
    """Chat with the model: the chat screen, or with --plain a REPL for scripts and pipes."""
    refuse_local_flags(ctx, url)
    from lm_console.chat_session import DEFAULT_SYSTEM_PROMPT, ChatSession
    from lm_console.client.types import GenParams

    args = {**engine_kwargs, "num_threads": console_threads(engine_kwargs.get("num_threads"))}
    client = make_client(fake, model, args, url, api_key, command="lmc chat")
    params = GenParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
    system_prompt = DEFAULT_SYSTEM_PROMPT if system is None else system
    if plain:
        from lm_console.chat_repl import run_repl

        session = ChatSession(client, system_prompt=system_prompt, params=params)
        try:
            code = asyncio.run(run_repl(client, session, show_stats=stats, images=list(image or [])))
        except KeyboardInterrupt:
            code = 130
        raise typer.Exit(code)
    from lm_console.tui.app import ConsoleApp

    app = ConsoleApp(client, chat_only=True, log_path=default_log_path())
    app.session.system_prompt = system_prompt
    app.session.params = params
    app.initial_images = list(image or [])
    run_app(app)


@engine_flags()
def events(
    ctx: typer.Context,
    engine_kwargs: dict[str, Any],
    model: ModelOpt = None,
    endpoint: Annotated[Optional[str], typer.Option(
        help="Attach to a running engine's KV-event PUB socket (e.g. ipc:///tmp/x) instead of starting one.")] = None,
    server_key: Annotated[Optional[str], typer.Option(
        help="The PUB's CURVE public key (llm.kv_events_server_key), needed for a tcp endpoint.")] = None,
    count: Annotated[Optional[int], typer.Option(help="Stop after this many events.")] = None,
    duration: Annotated[Optional[float], typer.Option(help="Stop after this many seconds.")] = None,
    load: Annotated[Optional[bool], typer.Option(
        "--load/--no-load", help="Drive the built-in load so blocks move (default: on, off with --url).")] = None,
    rate: RateOpt = 4.0, fake: FakeOpt = False,
    url: UrlOpt = None, api_key: ApiKeyOpt = None, kv_events_endpoint: KVEventsEndpointOpt = None,
) -> None:
    """Print the KV-cache event stream (BlockStored / BlockRemoved / AllBlocksCleared) as JSON lines."""
    from lm_console import events as events_mod

    refuse_local_flags(ctx, url)
    if server_key is not None and endpoint is None:
        raise typer.BadParameter("--server-key is the CURVE key of the --endpoint PUB socket; pass --endpoint too.")

    try:
        if endpoint:
            import zmq

            try:
                asyncio.run(events_mod.print_endpoint_events(endpoint, sys.stdout, count=count, duration=duration,
                                                             server_key=server_key))
            except (zmq.ZMQError, ValueError) as error:
                typer.echo(f"error: cannot subscribe to {endpoint!r}: {error} (an endpoint looks like "
                           "ipc:///path or tcp://127.0.0.1:5557; a tcp one needs --server-key)", err=True)
                raise typer.Exit(2) from None
            return
        args = {**engine_kwargs, "num_threads": console_threads(engine_kwargs.get("num_threads"))}
        client = make_client(fake, model, args, url, api_key, kv_events_endpoint, command="lmc events")
        shape = make_shape(rate, "32-192", "16-64", 0.5, 96)
        asyncio.run(events_mod.print_client_events(client, sys.stdout, count=count, duration=duration,
                                                    load=url is None if load is None else load, shape=shape))
    except (KeyboardInterrupt, BrokenPipeError):
        pass


def register(app: typer.Typer) -> None:
    """Add the console commands to the `lmc` app."""
    app.command()(tui)
    app.command()(chat)
    app.command()(events)
