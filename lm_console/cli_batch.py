"""`lmc batch`: run an OpenAI batch file through the engine (thin command over lm_console.batch)."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Annotated

import typer

from lm_console.engine_options import (
    DtypeOpt, MaxModelLenOpt, MaxNumSeqsOpt, ModelOpt, NumBlocksOpt, NumThreadsOpt, engine_args,
)
from lm_console.remote_options import ApiKeyOpt, UrlOpt, check_remote_flags, refuse_local_flags


def batch(
    ctx: typer.Context,
    input_file: Annotated[str, typer.Option("--input-file", "-i", help="Input .jsonl ('-' for stdin).")],
    output_file: Annotated[str, typer.Option("--output-file", "-o", help="Output .jsonl ('-' for stdout).")],
    model: ModelOpt = None, dtype: DtypeOpt = "auto", max_model_len: MaxModelLenOpt = None,
    num_blocks: NumBlocksOpt = None, max_num_seqs: MaxNumSeqsOpt = 128, num_threads: NumThreadsOpt = None,
    max_tokens: Annotated[int, typer.Option(help="max_tokens for requests that do not set it.")] = 256,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr.")] = True,
    url: UrlOpt = None, api_key: ApiKeyOpt = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Most requests in flight at once.")] = 64,
) -> None:
    """Run an OpenAI batch file (/v1/chat/completions, /v1/completions) like `vllm run-batch`."""
    from lm_console.batch import read_lines, run_batch

    check_remote_flags(url, model)
    refuse_local_flags(ctx, url)

    try:
        text = sys.stdin.read() if input_file == "-" else open(input_file, encoding="utf-8").read()
    except OSError as error:
        typer.echo(f"error: cannot read {input_file}: {error}", err=True)
        raise typer.Exit(2) from error
    lines = read_lines(text)
    args = engine_args(dtype, max_model_len, num_blocks, max_num_seqs=max_num_seqs, num_threads=num_threads)

    async def main() -> list[dict]:
        if url is not None:
            from lm_console.batch_remote import run_batch_remote

            return await run_batch_remote(url, lines, api_key, max_tokens, concurrency, progress)
        from engine.frontend.async_llm import AsyncLLM

        llm = AsyncLLM(model, **args)
        try:
            return await run_batch(llm, lines, model or "SmolLM2-135M-Instruct", max_tokens, progress, concurrency)
        finally:
            llm.shutdown()

    try:
        records = asyncio.run(main())
    except Exception as error:  # noqa: BLE001 - engine start failures and a dead engine
        hint = getattr(error, "hint", "")
        typer.echo(f"error: {type(error).__name__}: {error}" + (f"\n{hint}" if hint else ""), err=True)
        raise typer.Exit(2) from error
    out = "\n".join(json.dumps(r) for r in records) + ("\n" if records else "")
    if output_file == "-":
        sys.stdout.write(out)
    else:
        with open(output_file, "w", encoding="utf-8") as f:
            f.write(out)
    num_failed = sum(1 for r in records if r["error"] is not None)
    typer.echo(f"{len(records) - num_failed} succeeded, {num_failed} failed -> {output_file}", err=True)
