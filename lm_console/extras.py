"""Which optional extra a command needs, and the exit-2 message when it is not installed.

`pip install lm-console` is the console alone (no torch); the engine and the server are the
`[engine]` and `[serve]` extras (pyproject.toml). A command that needs one checks up front with
`require` (before a Textual app or an engine process could hide the ImportError), and `lmc`'s
entry point turns any ModuleNotFoundError of an extra's module into the same message.
Checking uses importlib.util.find_spec, which locates a module without importing it.
"""

from __future__ import annotations

import importlib.util

import typer

# The modules each extra brings that the code imports (top-level names), in pyproject's order.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "engine": ("torch", "transformers", "tokenizers", "safetensors", "gguf"),
    "serve": ("fastapi", "uvicorn", "prometheus_client"),
}
# Imported only by some paths (GPU kernels, image hashing, the server's models).
_ALSO_OF = {"triton": "engine", "blake3": "engine", "accelerate": "engine",
            "starlette": "serve", "pydantic": "serve"}
_WHAT = {"engine": "the engine", "serve": "the HTTP server"}


def missing_modules(extra: str) -> list[str]:
    """The modules of `extra` that are not installed (empty when it is)."""
    return [name for name in EXTRA_MODULES[extra] if importlib.util.find_spec(name) is None]


def install_hint(extra: str) -> str:
    """The pip command that installs `extra`."""
    return f"pip install 'lm-console[{extra}]'"


def extra_of_module(module: str | None) -> str | None:
    """The extra that provides `module` (a dotted name is judged by its top level), else None."""
    if not module:
        return None
    top = module.split(".")[0]
    for extra, names in EXTRA_MODULES.items():
        if top in names:
            return extra
    return _ALSO_OF.get(top)


def missing_message(command: str, extra: str, missing: list[str]) -> str:
    """`error: lmc generate needs the engine (torch not installed): pip install 'lm-console[engine]'`."""
    return (f"error: {command} needs {_WHAT[extra]} ({', '.join(missing)} not installed): "
            f"{install_hint(extra)}")


def require(command: str, *extras: str) -> None:
    """Exit 2 with the install hint when one of `extras` is not installed."""
    for extra in extras:
        missing = missing_modules(extra)
        if missing:
            typer.echo(missing_message(command, extra, missing), err=True)
            raise typer.Exit(2)
