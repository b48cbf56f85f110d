"""`lmc batch`: run an OpenAI batch file through the engine (thin command over lm_console.batch)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import IO, Annotated, Any, BinaryIO, Optional, TextIO

import typer

from lm_console.batch import DEFAULT_MAX_LINE_BYTES
from lm_console.engine_options import ModelOpt, engine_flags
from lm_console.remote_options import ApiKeyOpt, UrlOpt, check_remote_flags, refuse_local_flags
from lm_console.extras import require


@engine_flags()
def batch(
    ctx: typer.Context,
    engine_kwargs: dict[str, Any],
    input_file: Annotated[str, typer.Option("--input-file", "-i", help="Input .jsonl ('-' for stdin).")],
    output_file: Annotated[str, typer.Option("--output-file", "-o", help="Output .jsonl ('-' for stdout).")],
    model: ModelOpt = None,
    max_tokens: Annotated[int, typer.Option(help="max_tokens for requests that do not set it.")] = 256,
    max_line_bytes: Annotated[int, typer.Option(
        min=1, help="Longest input line; a longer one becomes an error record, unread.")] = DEFAULT_MAX_LINE_BYTES,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr.")] = True,
    url: UrlOpt = None, api_key: ApiKeyOpt = None,
    concurrency: Annotated[Optional[int], typer.Option(
        min=1, help="Most requests in flight at once (default: 64 with --url; a local engine takes up to "
                    "512 and schedules them itself).")] = None,
) -> None:
    """Run an OpenAI batch file (/v1/chat/completions, /v1/completions) like `vllm run-batch`.

    The input is streamed and each record is written (in input order) as soon as it is done,
    so memory stays bounded and a failed job keeps the records it finished. With --url the
    lines go to a running server's /v1 endpoints instead of an engine of this command's own.
    """
    from lm_console.batch import read_input_lines, stream_batch

    check_remote_flags(url, model)
    refuse_local_flags(ctx, url)
    if url is None:
        require("lmc batch", "engine")
    source = _open_input(input_file)
    target = _open_output(output_file, input_file)
    args = dict(engine_kwargs)

    def write(record: dict) -> None:
        try:
            target.write(json.dumps(record) + "\n")
            target.flush()
        except OSError as error:  # a full disk, /dev/full, a closed pipe: the job cannot go on
            raise BatchOutputError(f"cannot write {output_file}: {error.strerror or error}") from None

    async def main() -> tuple[int, int]:
        lines = read_input_lines(source, max_line_bytes)
        if url is not None:
            from lm_console.batch_remote import DEFAULT_CONCURRENCY, stream_batch_remote

            return await stream_batch_remote(url, lines, write, api_key, max_tokens,
                                             concurrency or DEFAULT_CONCURRENCY, progress)
        from lm_console.engine.frontend.async_llm import AsyncLLM

        llm = AsyncLLM(model, **args)
        try:
            return await stream_batch(llm, lines, write, model or "SmolLM2-135M-Instruct", max_tokens, progress,
                                      concurrency=concurrency)
        finally:
            llm.shutdown()

    try:
        num_written, num_failed = asyncio.run(main())
    except BatchOutputError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    except Exception as error:  # noqa: BLE001 - engine start failures, a dead engine, an unusable server
        hint = getattr(error, "hint", "")  # EngineUnavailable says what to do
        typer.echo(f"error: {type(error).__name__}: {error}" + (f"\n{hint}" if hint else ""), err=True)
        raise typer.Exit(2) from None
    finally:
        _close_quietly(target, sys.stdout)
        _close_quietly(source, sys.stdin.buffer)
    typer.echo(f"{num_written - num_failed} succeeded, {num_failed} failed -> {output_file}", err=True)


class BatchOutputError(OSError):
    """The output file cannot be written (full disk, closed pipe): the job stops, one error line."""


def _close_quietly(stream: IO[Any], standard: IO[Any]) -> None:
    """Close a file we opened; a close that fails (its buffer cannot be flushed to a full disk)
    was already reported by the write that failed first."""
    if stream is standard:
        return
    try:
        stream.close()
    except OSError:
        pass


def _open_input(path: str) -> BinaryIO:
    if path == "-":
        return sys.stdin.buffer
    try:
        return open(path, "rb")
    except OSError as error:
        typer.echo(f"error: cannot read {path}: {error.strerror or error}", err=True)
        raise typer.Exit(2) from None


def _open_output(path: str, input_path: str) -> TextIO:
    """The output, opened before the engine starts: an unwritable path fails at once."""
    if path == "-":
        return sys.stdout
    if input_path != "-" and os.path.exists(path) and os.path.samefile(path, input_path):
        typer.echo(f"error: the output file {path} is the input file; write the results elsewhere.", err=True)
        raise typer.Exit(2)
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as error:
        typer.echo(f"error: cannot write {path}: {error.strerror or error}", err=True)
        raise typer.Exit(2) from None
