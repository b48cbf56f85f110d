"""`lmc serve [MODEL]`: the OpenAI-compatible HTTP server over AsyncLLM (a thin Typer command).

Same engine flags as `lmc tui` (lm_console/engine_options.py, kv_options.py); the server's own
flags go to ServerSettings. Exit codes: 0 after a drain (SIGINT / SIGTERM), 1 when the engine
core died (so a supervisor restarts the server), 2 when the engine or the flags were refused.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from lm_console.engine_options import ModelOpt, SpeculativeConfigOpt, engine_flags, speculative_args
from lm_console.extras import require
from lm_console.kv_options import (
    KVChunkSizeOpt, KVOffloadCpuBytesOpt, KVOffloadDiskBytesOpt, KVOffloadDiskOpt, KVOffloadOpt, KVTransferConfigOpt,
    kv_transfer_args,
)

ModelArg = Annotated[Optional[str], typer.Argument(
    metavar="MODEL", help="Model name, HF-format directory or .gguf file (same as --model).")]


# A server runs for long: its first requests should not pay the KV cache's page faults.
@engine_flags({"kv_cache_prefault": True})
def serve(
    engine_kwargs: dict[str, Any],
    model_arg: ModelArg = None,
    model: ModelOpt = None,
    kv_transfer_config: KVTransferConfigOpt = None, kv_offload: KVOffloadOpt = False,
    kv_offload_disk: KVOffloadDiskOpt = None, kv_offload_cpu_bytes: KVOffloadCpuBytesOpt = 2 << 30,
    kv_offload_disk_bytes: KVOffloadDiskBytesOpt = 16 << 30, kv_chunk_size: KVChunkSizeOpt = 256,
    speculative_config: SpeculativeConfigOpt = None,
    lora_modules: Annotated[Optional[list[str]], typer.Option(
        "--lora-modules", help="A LoRA adapter to serve as NAME=PATH, or 'pirate' (the built-in demo adapter for the "
                               "embedded model), repeatable; needs --enable-lora: requests "
                               "choose it with model=NAME, /v1/models lists it with the base model as parent.")] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port, printed at start-up).")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(
        envvar="LMC_API_KEY", help="Require 'Authorization: Bearer KEY' on every route but /health, /metrics and "
                                   "/version (/docs, /openapi.json and /redoc included); checked before the body "
                                   "is read.")] = None,
    served_model_name: Annotated[Optional[list[str]], typer.Option(
        help="Name(s) clients use in 'model' (repeatable; the first is the default and the metrics label).")] = None,
    allowed_local_media_path: Annotated[Optional[Path], typer.Option(
        help="Allow file:// image URLs under this directory (off by default).")] = None,
    max_request_body: Annotated[int, typer.Option(help="Largest request body in bytes (413 beyond).")] = 32 << 20,
    header_timeout: Annotated[float, typer.Option(
        help="Seconds a client has to send a request's headers; then the connection is closed.")] = 10.0,
    body_timeout: Annotated[float, typer.Option(
        help="Seconds a client has to send a request's body after its headers (408 and closed beyond).")] = 60.0,
    max_request_work: Annotated[int, typer.Option(
        help="Most token entries one request may ask for: per prompt n x max_tokens x (1 + logprobs), plus its "
             "prompt tokens x (1 + prompt_logprobs) and n x its tokens with echo (400 beyond, before any work).",
    )] = 2_000_000,
    max_image_pixels: Annotated[int, typer.Option(
        help="Most pixels (width x height, read from the header before decoding) an image may have; at most "
             "36000000, the engine's own cap.")] = 6000 * 6000,
    media_fetch_timeout: Annotated[float, typer.Option(
        help="Seconds an http(s) image URL's whole fetch may take, redirects included.")] = 10.0,
    allow_private_media_urls: Annotated[bool, typer.Option(
        help="Fetch image URLs that resolve to loopback, private or link-local addresses (refused by default).",
    )] = False,
    max_structured_output_bytes: Annotated[int, typer.Option(
        help="Largest output constraint (JSON schema, regex, grammar, choices) in bytes.")] = 64 << 10,
    max_structured_output_choices: Annotated[int, typer.Option(
        help="Most choices in a guided_choice / structured_outputs.choice constraint.")] = 1024,
    kv_events_endpoint: Annotated[Optional[str], typer.Option(
        help="Publish KV cache events on this ZMQ endpoint for outside subscribers, e.g. tcp://127.0.0.1:5557 "
             "(tcp is CURVE-authenticated: the start-up line prints the server key; ipc:// is plain).",
    )] = None,
    otlp_traces_endpoint: Annotated[Optional[str], typer.Option(
        help="Export one OpenTelemetry span per finished request (\"llm_request\", vLLM's attributes) to this "
             "OTLP/HTTP URL, e.g. http://localhost:4318/v1/traces; a client's traceparent header is its parent. "
             "Needs the otel extra.")] = None,
    shutdown_timeout: Annotated[float, typer.Option(
        help="Seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted.")] = 10.0,
    log_level: Annotated[str, typer.Option(help="debug | info | warning | error.")] = "info",
    enable_auto_tool_choice: Annotated[bool, typer.Option(
        help="Serve tool_choice 'auto' (the default when a request has tools): the model's calls are read "
             "from its text by --tool-call-parser.")] = False,
    tool_call_parser: Annotated[Optional[str], typer.Option(
        help="How tool calls are read from the model's text: hermes (<tool_call>{...}</tool_call> blocks, "
             "the format of the shipped ChatML templates).")] = None,
    pooler_config: Annotated[Optional[str], typer.Option(
        help='How /v1/embeddings pools the last hidden states, as JSON: {"pooling_type": "LAST" | "MEAN", '
             '"normalize": true | false} (default LAST, normalized).')] = None,
) -> None:
    """Serve the OpenAI API (completions, chat, tokenizer) and Prometheus /metrics over HTTP."""
    require("lmc serve", "engine", "serve")
    from lm_console.engine.errors import EngineError

    if model_arg and model and model_arg != model:
        raise typer.BadParameter(f"MODEL {model_arg!r} and --model {model!r} disagree; give one of them.")
    model = model_arg or model
    if kv_events_endpoint is not None and not kv_events_endpoint.startswith(("tcp://", "ipc://")):
        raise typer.BadParameter(f"--kv-events-endpoint must be a ZMQ tcp:// (or ipc://) address, "
                                 f"got {kv_events_endpoint!r}.")
    if allowed_local_media_path is not None and not allowed_local_media_path.is_dir():
        raise typer.BadParameter(f"--allowed-local-media-path {str(allowed_local_media_path)!r} is not a directory.")
    from lm_console.engine.multimodal.image import MAX_IMAGE_PIXELS

    if max_image_pixels > MAX_IMAGE_PIXELS:
        raise typer.BadParameter(f"--max-image-pixels {max_image_pixels} is over the engine's cap of "
                                 f"{MAX_IMAGE_PIXELS} pixels, which it enforces on every image.")
    from lm_console.engine.entrypoints.openai.serving_lora import parse_lora_modules

    try:
        modules = parse_lora_modules(lora_modules or [])
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error
    if modules and not engine_kwargs.get("enable_lora", False):
        raise typer.BadParameter("--lora-modules needs --enable-lora.")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from lm_console.engine.entrypoints.openai.settings import ServerSettings

    from lm_console.engine.errors import InvalidSamplingParamsError
    from lm_console.engine.sampling_params import PoolingParams

    try:
        pooling = PoolingParams(**json.loads(pooler_config)) if pooler_config else PoolingParams()
    except (ValueError, TypeError, InvalidSamplingParamsError) as error:
        raise typer.BadParameter(f"--pooler-config {pooler_config!r}: {error} (keys: pooling_type, normalize)."
                                 ) from error
    try:
        settings = ServerSettings(host=host, port=port, api_key=api_key or None,
                                  served_model_names=tuple(served_model_name or ()),
                                  allowed_local_media_path=allowed_local_media_path,
                                  max_request_body=max_request_body, shutdown_timeout_s=shutdown_timeout,
                                  header_timeout_s=header_timeout, body_timeout_s=body_timeout,
                                  max_request_work=max_request_work, max_image_pixels=max_image_pixels,
                                  allow_private_media_urls=allow_private_media_urls,
                                  media_fetch_timeout_s=media_fetch_timeout,
                                  max_structured_output_bytes=max_structured_output_bytes,
                                  max_structured_output_choices=max_structured_output_choices,
                                  log_level=log_level.lower(),
                                  enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                                  pooler_config=pooling, lora_modules=tuple(modules))
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error
    args = dict(engine_kwargs)
    args.update(kv_transfer_args(kv_transfer_config, kv_offload, kv_offload_disk, kv_offload_cpu_bytes,
                                 kv_offload_disk_bytes, kv_chunk_size))
    if kv_events_endpoint is not None:
        args.update(enable_kv_cache_events=True, kv_events_endpoint=kv_events_endpoint)
    if otlp_traces_endpoint is not None:
        args.update(otlp_traces_endpoint=otlp_traces_endpoint)
    args.update(speculative_args(speculative_config))
    from lm_console.engine.entrypoints.openai.api_server import run_server
    from lm_console.engine import AsyncLLM

    try:
        engine = AsyncLLM(model, **args)
    except EngineError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from error

    def on_ready(url: str) -> None:
        name = settings.served_model_names[0] if settings.served_model_names else engine.config.model_config.model_name
        key = engine.kv_events_server_key  # a tcp PUB is a CURVE server: subscribers need its public key
        events = ""
        if kv_events_endpoint:
            events = f"; KV events on {engine.kv_events_endpoint}" + (f" (CURVE server key {key})" if key else "")
        pid = engine.engine_core.ready_info.pid
        traces = f"; request spans to {otlp_traces_endpoint}" if otlp_traces_endpoint else ""
        typer.echo(f"lmc serve: {name} ready at {url} (OpenAI API under {url}/v1, metrics at {url}/metrics"
                   f"{events}{traces}; engine core pid {pid})")
        sys.stdout.flush()

    from lm_console.engine.entrypoints.openai.errors import OpenAIError

    try:
        code = run_server(engine, settings, on_ready=on_ready)
    except OSError as error:  # the port is taken, the host is not ours
        typer.echo(f"error: cannot listen on {host}:{port}: {error}", err=True)
        raise typer.Exit(2) from error
    except OpenAIError as error:  # a --lora-modules adapter that this engine cannot run
        typer.echo(f"error: --lora-modules: {error.message}", err=True)
        raise typer.Exit(2) from error
    raise typer.Exit(code)
