"""The engine's `lmc` flags, derived from the knobs' declarations (lm_console/engine/config/).

Each knob declared with a flag (knob(cli=...), lm_console/engine/config/fields.py) becomes an
option of every command that starts an engine (@engine_flags): its name, type, choices, bounds,
help and default come from the declaration, so a new knob is written once, on its config class.
The command receives `engine_kwargs`: the EngineArgs keywords of the flags whose value differs from
the knob's default (the engine's own default applies to the rest).
"""

from __future__ import annotations

import enum
import functools
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, Optional, TypeVar

import typer

from lm_console.engine.config.fields import Declaration
from lm_console.engine.config.knobs import engine_arg_declarations

F = TypeVar("F", bound=Callable[..., Any])

FakeOpt = Annotated[bool, typer.Option("--fake", help="Use the built-in fake engine (no model; for demos and tests).")]


def flag_declarations() -> dict[str, Declaration]:
    """EngineArgs keyword -> declaration, for the knobs that have an `lmc` flag."""
    return {name: decl for name, decl in engine_arg_declarations().items() if decl.flag is not None}


def param_name(decl: Declaration) -> str:
    """The command parameter of a knob's flag (--num-blocks: num_blocks), as click names it."""
    flag = decl.flag
    assert flag is not None
    return flag.split()[0].lstrip("-").replace("-", "_")


def engine_flag_params() -> frozenset[str]:
    """The command parameters of every engine flag (--url refuses them: remote_options.py)."""
    return frozenset(param_name(decl) for decl in flag_declarations().values())


@functools.cache
def _choice_enum(decl: Declaration) -> type[enum.Enum]:
    """A str Enum of the knob's choices: typer (every version we support) renders and checks it."""
    choices = [c for c in decl.choices or () if c is not None]
    return enum.Enum(decl.arg.title().replace("_", ""), {str(c): str(c) for c in choices}, type=str)  # type: ignore[return-value]


def flag_option(decl: Declaration) -> tuple[Any, Any]:
    """(annotation, default) of a knob's flag: Annotated[type, typer.Option(...)] and the flag's
    spelling of the knob's default."""
    flag = decl.flag
    assert flag is not None
    decls = flag.split()
    spec = decl.spec
    default = decl.default_value()
    if default is None and spec.cli_none is not None:
        default = spec.cli_none
    hint = decl.arg_type
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args and typing.get_origin(hint) is not \
        typing.Literal else hint
    options: dict[str, Any] = {"help": spec.help, "rich_help_panel": "Engine options"}
    if decl.choices is not None:
        kind: Any = _choice_enum(decl)
        default = None if default is None else kind(str(default))
    elif base is bool:
        kind = bool
        decls = [f"{decls[0]}/--no-{decls[0][2:]}", *decls[1:]]
    else:
        kind = base
        # Closed bounds here; an open one (gt, lt) is refused by the engine with its message.
        low = spec.ge if spec.ge is not None else spec.gt
        high = spec.le if spec.le is not None else spec.lt
        if spec.cli_none is not None and low is not None:
            low = min(low, spec.cli_none)
        if low is not None:
            options["min"] = kind(low)
        if high is not None:
            options["max"] = kind(high)
    annotation = Optional[kind] if (optional and spec.cli_none is None) or default is None else kind
    return Annotated[annotation, typer.Option(*decls, **options)], default


def engine_flags(defaults: Mapping[str, Any] | None = None, *, only: Iterable[str] | None = None,
                 exclude: Iterable[str] = ()) -> Callable[[F], F]:
    """Give a Typer command every engine flag (those its own signature does not declare), or
    `only` those, less `exclude` (EngineArgs keywords).

    The command takes `engine_kwargs: dict[str, Any]`: the EngineArgs keywords of the flags set away
    from their knob's default. `defaults` (EngineArgs keyword -> value) changes a flag's default
    for this command (`lmc chat`: 16 sequences; `lmc serve`: kv_cache_prefault on).
    """
    defaults = dict(defaults or {})
    exclude = set(exclude)
    unknown = sorted((set(defaults) | exclude | set(only or ())) - set(flag_declarations()))
    if unknown:
        raise ValueError(f"engine_flags: no engine flag for {unknown}")
    chosen = [name for name in (only if only is not None else flag_declarations()) if name not in exclude]

    def wrap(func: F) -> F:
        signature = inspect.signature(func, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "engine_kwargs"]
        taken = {p.name for p in own}
        added: dict[str, Declaration] = {}
        params = list(own)
        for name in chosen:
            decl = flag_declarations()[name]
            pname = param_name(decl)
            if pname in taken:
                continue  # the command spells this flag itself
            annotation, default = flag_option(decl)
            if name in defaults:
                default = defaults[name]
            added[pname] = decl
            params.append(inspect.Parameter(pname, inspect.Parameter.KEYWORD_ONLY, default=default,
                                            annotation=annotation))

        @functools.wraps(func)
        def command(*args: Any, **kwargs: Any) -> Any:
            flags = {pname: kwargs.pop(pname) for pname in added}
            given = {added[p].arg: v for p, v in flags.items()}
            return func(*args, engine_kwargs=engine_kwargs(given, keep=defaults), **kwargs)

        command.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command  # type: ignore[return-value]

    return wrap


def engine_kwargs(values: Mapping[str, Any], keep: Iterable[str] = ()) -> dict[str, Any]:
    """EngineArgs keywords of flag values (keyword -> value as the flag gave it): a choice as its
    str, the flag's stand-in for None as None; the knobs' defaults left out, but for the `keep`
    keywords (a command's own defaults, passed on whatever their value)."""
    keep = set(keep)
    declared = flag_declarations()
    args: dict[str, Any] = {}
    for name, value in values.items():
        decl = declared[name]
        if isinstance(value, enum.Enum):
            value = value.value
        if decl.spec.cli_none is not None and value == decl.spec.cli_none:
            value = None
        if name in keep or value != decl.default_value() or type(value) is not type(decl.default_value()):
            args[name] = value
    return args


def engine_option(name: str) -> Any:
    """The Annotated type of one knob's flag, for a command that declares it itself (--model)."""
    return flag_option(flag_declarations()[name])[0]


ModelOpt = engine_option("model")


def serve_flags(engine_args: Mapping[str, Any]) -> list[str]:
    """The `lmc serve` flags that give an engine these EngineArgs keywords (keywords without a
    flag: ValueError)."""
    declared = flag_declarations()
    flags: list[str] = []
    for name, value in engine_args.items():
        decl = declared.get(name)
        if decl is None:
            raise ValueError(f"{name} has no `lmc serve` flag")
        flag = decl.flag.split()[0]  # type: ignore[union-attr]
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        elif value is None:
            if decl.spec.cli_none is None:
                continue  # the flag's own default
            none = decl.spec.cli_none
            flags += [flag, str(int(none)) if isinstance(none, float) and none.is_integer() else str(none)]
        else:
            flags += [flag, str(value)]
    return flags


def console_threads(num_threads: int | None) -> int:
    """Engine threads when the console shares the machine: leave one core to the console.

    The console's process (tokenizer, detokenizer, rendering) needs CPU too; on a 2-core machine
    an engine with 2 threads fights it and steps slow down many times over.
    """
    if num_threads is not None:
        return num_threads
    from lm_console.engine.platform import usable_cpus

    return max(usable_cpus() - 1, 1)


def parse_range(text: str, name: str) -> tuple[int, int]:
    """'32-192' or '64' -> (low, high); a clear error otherwise."""
    low, _, high = text.partition("-")
    try:
        pair = (int(low), int(high or low))
    except ValueError:
        raise typer.BadParameter(f"{name} must look like 32-192 or 64, got {text!r}") from None
    if not 1 <= pair[0] <= pair[1]:
        raise typer.BadParameter(f"{name} must satisfy 1 <= min <= max, got {text!r}")
    return pair


SpeculativeConfigOpt = Annotated[Optional[str], typer.Option(
    "--speculative-config",
    help='Speculative decoding as JSON (vLLM\'s flag), e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'; '
         'methods: ngram, suffix.')]


def speculative_args(speculative_config: str | None) -> dict[str, Any]:
    """{"speculative_config": ...} for EngineArgs, or {} when speculation was not asked for; the
    config's own parse checks the JSON, so a bad value is refused here, before any engine starts."""
    if not speculative_config:
        return {}
    from lm_console.engine.config.speculative import SpeculativeConfig
    from lm_console.engine.errors import InvalidEngineArgsError

    try:
        return {"speculative_config": SpeculativeConfig.parse(speculative_config)}
    except InvalidEngineArgsError as error:
        raise typer.BadParameter(str(error)) from None
