"""`lmc`: the lm-console command line (thin Typer commands that call the engine)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from lm_console.engine_options import engine_flags
from lm_console.extras import extra_of_module, missing_message, require

app = typer.Typer(
    help="lm-console: a small vLLM-style inference engine with an operator console.",
    no_args_is_help=True,
    add_completion=False,
)
# Set by a one-shot command (generate) once its output is written: main() may then end the
# process without the interpreter's teardown (_exit_now).
_one_shot_done = False


def _print_version(value: bool) -> None:
    if value:
        from lm_console.engine.version import __version__

        typer.echo(f"lm-console {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Options before the command (`lmc --version`); the app's help text is Typer(help=...)."""


models_app = typer.Typer(help="List the known models, or print a model's directory.",
                         invoke_without_command=True)
app.add_typer(models_app, name="models")


@models_app.callback()
def models_list(ctx: typer.Context) -> None:
    """List the known models (the embedded default first)."""
    if ctx.invoked_subcommand is not None:
        return
    from lm_console.engine.models.embedded import list_known_models

    for model in list_known_models():
        state = "converted" if model.converted else "not converted yet"
        typer.echo(f"{model.name}\t{model.description} [{model.license}] ({state})")


@models_app.command("path")
def models_path(name: Optional[str] = typer.Argument(None, help="Model name, directory or .gguf file.")) -> None:
    """Print the HF-format directory of a model (converting it first if needed) as the last line."""
    from lm_console.engine.errors import EngineError
    from lm_console.engine.models.embedded import resolve_model_path

    try:
        path = resolve_model_path(name)
    except EngineError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from error
    typer.echo(str(path))


@app.command()
@engine_flags()
def generate(
    engine_kwargs: dict[str, Any],
    prompt: str = typer.Argument(..., help="The prompt text."),
    model: Optional[str] = typer.Option(None, help="Model name, HF-format directory or .gguf file."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the chat template."),
    system: Optional[str] = typer.Option(None, help="System prompt (with --chat)."),
    max_tokens: int = typer.Option(128, help="Maximum tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 means greedy."),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(-1),
    min_p: float = typer.Option(0.0),
    repetition_penalty: float = typer.Option(1.0),
    seed: Optional[int] = typer.Option(None, help="Per-request sampling seed."),
    n: int = typer.Option(1, help="Number of completions."),
    stop: Optional[list[str]] = typer.Option(None, help="Stop string (repeatable)."),
    lora: Optional[str] = typer.Option(
        None, "--lora", help="Run with this LoRA adapter: NAME=PATH (a PEFT adapter directory), or 'pirate', the "
              "built-in demo adapter for the embedded model."),
) -> None:
    """Generate a completion for PROMPT with the engine (offline, in this process)."""
    global _one_shot_done
    from lm_console.engine.startup_trace import mark

    mark("cli")
    require("lmc generate", "engine")
    from lm_console.engine import LLM, SamplingParams
    from lm_console.engine.errors import EngineError

    mark("engine_import")

    lora_request, lora_engine_args = _lora_option(lora)
    try:
        params = SamplingParams(
            n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            repetition_penalty=repetition_penalty, seed=seed, max_tokens=max_tokens, stop=stop,
        )
        # One process: the engine core runs here (InprocClient), so torch and the engine import
        # once, not again in a forked core; the tokenizer loads on a thread meanwhile.
        # --lora turns LoRA on with room for its rank, unless the flags say otherwise.
        llm = LLM(model=model, **{**lora_engine_args, **engine_kwargs, "multiprocess": False})
        if chat:
            messages = ([{"role": "system", "content": system}] if system else [])
            messages.append({"role": "user", "content": prompt})
            outputs = llm.chat(messages, params, use_tqdm=False, lora_request=lora_request)
        else:
            outputs = llm.generate(prompt, params, use_tqdm=False, lora_request=lora_request)
    except EngineError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from error
    for completion in outputs[0].outputs:
        if n > 1:
            typer.echo(f"--- completion {completion.index} ({completion.finish_reason})")
        typer.echo(completion.text)
    sys.stdout.flush()
    mark("done")
    _one_shot_done = True


def _lora_option(spec: str | None) -> tuple[Any, dict[str, Any]]:
    """--lora NAME=PATH (or a built-in adapter's name) -> (its LoRARequest, the engine arguments
    that let it run: LoRA on, rank room for it); (None, {}) without --lora."""
    if spec is None:
        return None, {}
    from lm_console.engine.lora.builtin import BUILTIN_ADAPTERS, builtin_adapter

    name, sep, path = spec.partition("=")
    if not sep and (builtin := builtin_adapter(spec)) is not None:
        name, path = builtin
    elif not sep or not name.strip() or not path.strip():
        raise typer.BadParameter(f"--lora {spec!r} must look like NAME=PATH (a PEFT adapter directory) "
                                 f"or name a built-in adapter ({', '.join(BUILTIN_ADAPTERS)}).")
    import json

    from lm_console.engine.errors import EngineError
    from lm_console.engine.lora import LoRARequest

    rank = 16
    try:  # room for the adapter's rank; the engine checks the adapter itself
        with open(Path(path.strip()) / "adapter_config.json", "rb") as f:
            declared = json.loads(f.read(1 << 20)).get("r")
        if isinstance(declared, int) and not isinstance(declared, bool) and declared > rank:
            rank = declared
    except (OSError, ValueError, AttributeError):
        pass  # the engine's admission check names what is wrong with the files
    try:
        request = LoRARequest(name.strip(), 1, path.strip())
    except EngineError as error:
        raise typer.BadParameter(str(error)) from error
    return request, {"enable_lora": True, "max_lora_rank": rank}


def _register_commands() -> None:
    """The console, benchmark and batch commands live in their own modules."""
    from lm_console.cli_batch import batch
    from lm_console.cli_bench import bench_app
    from lm_console.cli_console import register
    from lm_console.cli_serve import serve
    from lm_console.cli_top import top

    register(app)
    app.add_typer(bench_app, name="bench")
    app.command()(batch)
    app.command()(serve)
    app.command()(top)


_register_commands()


def _exit_now(code: int) -> None:
    """End the process after a one-shot command: atexit handlers run as usual, then os._exit
    skips the interpreter's module teardown, which with torch loaded took 2-4 s of wall time on
    a busy 2-core box (the engine core ran in this process and holds no other resources)."""
    import atexit
    import os

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    """The `lmc` console script: the Typer app, with a missing optional extra told, not traced."""
    try:
        app()
    except SystemExit as done:
        if _one_shot_done and done.code in (0, None):
            _exit_now(0)
        raise
    except ModuleNotFoundError as error:
        extra = extra_of_module(error.name)
        if extra is None:
            raise
        typer.echo(missing_message("this command", extra, [str(error.name).split(".")[0]]), err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
