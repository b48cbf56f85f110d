"""Engine knobs declared once, on their config class: `knob()` fields, checked from their types.

A knob is a dataclass field made with `knob(default, help=..., ge=..., ...)` on a config class
that derives from `DeclaredConfig`. Its annotation is the rule: `Literal[...]` for a choice,
`int` / `float` / `bool` / `str`, `X | None` where None is allowed; `ge`/`gt`/`le`/`lt` bound a
number. From that one declaration come:

- the check (`verify_values`): run by the class's `__post_init__` on every instance and by
  `EngineArgs` on the user's values before anything starts, raising InvalidEngineArgsError that
  names the argument and what it accepts;
- the `EngineArgs` field of the same name (or `arg=`), with the same default
  (lm_console/engine/config/engine_args.py derives its fields from `engine_knobs()`);
- the `lmc` flag (`cli=`; lm_console/engine_options.py builds its type, choices, bounds, help
  and default from the declaration);
- the docs' configuration reference (docs/hooks/reference.py).

This module imports neither torch nor any subsystem: boundary modules load it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

from lm_console.engine.errors import InvalidEngineArgsError

_KNOB = "lm_console.knob"


class _Unset:
    """The arg_default of a knob whose EngineArgs default is the field's own."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()
_INT64 = 2**63


@dataclass(frozen=True)
class Knob:
    """One knob's declaration beyond its type and default (the field's metadata)."""

    help: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    # The EngineArgs keyword when it differs from the field's name (SchedulerConfig.policy is
    # EngineArgs.scheduling_policy, as in vLLM).
    arg: str | None = None
    # The EngineArgs annotation when the user passes a raw form that `parse` turns into the
    # field's value (kv_transfer_config: a dict or a JSON string -> KVTransferConfig).
    arg_type: Any = None
    # The EngineArgs default when the field has none (a resolved fact the user may leave unset:
    # ModelConfig.max_model_len, "the model's") or holds the resolved form of it.
    arg_default: Any = UNSET
    parse: Callable[[Any], Any] | None = None
    # The `lmc` flag: None, no flag; "" the field's own name (--max-num-seqs); else the flag
    # ("--num-blocks"). A bool gets the --x/--no-x pair.
    cli: str | None = ""
    # The flag's value that stands for None (--liveness-timeout 0: never), where None is not
    # something a flag can spell.
    cli_none: Any = None
    # False: the engine fills the field (a resolved fact such as CacheConfig.num_blocks); it is
    # checked like a knob but is no EngineArgs keyword and has no flag.
    user: bool = True
    power_of_two: bool = False
    # A sentence added to the refusal of a given value (an fp8 KV cache: "use int8").
    advice: Callable[[Any], str] | None = None


def declare(*, help: str, ge: float | None = None,  # noqa: A002 - the word every CLI uses
            gt: float | None = None, le: float | None = None, lt: float | None = None, arg: str | None = None,
            arg_type: Any = None, arg_default: Any = UNSET, parse: Callable[[Any], Any] | None = None,
            cli: str | None = "", cli_none: Any = None, user: bool = True, power_of_two: bool = False,
            advice: Callable[[Any], str] | None = None) -> dict[str, Knob]:
    """A field's metadata declaring it a knob: `field(metadata=declare(...))` for a field with no
    default (a resolved fact whose EngineArgs form has arg_default); knob() for the others."""
    return {_KNOB: Knob(help=help, ge=ge, gt=gt, le=le, lt=lt, arg=arg, arg_type=arg_type, arg_default=arg_default,
                        parse=parse, cli=cli if user else None, cli_none=cli_none, user=user,
                        power_of_two=power_of_two, advice=advice)}


def knob(default: Any = dataclasses.MISSING, *, default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
         **spec: Any) -> Any:
    """A config field declared as a knob, with its default (see the module docstring and declare())."""
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=declare(**spec))
    return dataclasses.field(default=default, metadata=declare(**spec))


@dataclass(frozen=True)
class Declaration:
    """A knob as its users see it: the config class and field it lives on, its type and default."""

    owner: type
    field: str
    spec: Knob
    type: Any  # the resolved annotation (Literal[...], int | None, ...)
    default: Any  # dataclasses.MISSING for a required field
    default_factory: Any  # dataclasses.MISSING unless the default is computed per instance

    @property
    def arg(self) -> str:
        """The EngineArgs keyword."""
        return self.spec.arg or self.field

    @property
    def arg_type(self) -> Any:
        """The EngineArgs annotation (the raw form where the knob parses one)."""
        return self.spec.arg_type if self.spec.arg_type is not None else self.type

    @property
    def flag(self) -> str | None:
        """The `lmc` flag's long name (None: no flag)."""
        if self.spec.cli is None:
            return None
        return self.spec.cli or "--" + self.arg.replace("_", "-")

    def default_value(self) -> Any:
        """The EngineArgs default (the factory's value for a computed one)."""
        if self.spec.arg_default is not UNSET:
            return self.spec.arg_default
        if self.default_factory is not dataclasses.MISSING:
            return self.default_factory()
        return self.default

    @property
    def choices(self) -> tuple[Any, ...] | None:
        """The Literal's values the user may pass, None for an open type."""
        literal = _literal_of(self.arg_type)
        return None if literal is None else tuple(literal)

    def describe(self, *, by_arg: bool = True) -> str:
        """What the knob accepts, in words: the text of every error about it."""
        return _describe(self.arg_type if by_arg else self.type, self.spec)


class DeclaredConfig:
    """Base of the config classes: their knobs are checked whenever an instance is made."""

    def __post_init__(self) -> None:
        verify_values(type(self), {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})  # type: ignore[arg-type]

    @classmethod
    def verify_relations(cls, values: Mapping[str, Any]) -> None:
        """Rules that tie this class's fields together (InvalidEngineArgsError); override it."""


_DECLARATIONS: dict[type, tuple[Declaration, ...]] = {}


def declarations(cls: type) -> tuple[Declaration, ...]:
    """The knobs (and checked engine-filled fields) of a config class, in field order."""
    found = _DECLARATIONS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        found = tuple(
            Declaration(owner=cls, field=f.name, spec=f.metadata[_KNOB], type=hints[f.name], default=f.default,
                        default_factory=f.default_factory)
            for f in dataclasses.fields(cls) if _KNOB in f.metadata)
        _DECLARATIONS[cls] = found
    return found


def engine_knobs(classes: tuple[type, ...]) -> Iterator[Declaration]:
    """The user's knobs of these classes, in order (the EngineArgs fields)."""
    for cls in classes:
        yield from (d for d in declarations(cls) if d.spec.user)


def verify_values(cls: type, values: Mapping[str, Any], *, by_arg: bool = False) -> None:
    """Check the values of cls's declared fields (keyed by field name, or by EngineArgs keyword
    with by_arg), then the class's verify_relations; InvalidEngineArgsError naming the first
    value refused and what its knob accepts."""
    fields: dict[str, Any] = {}
    for decl in declarations(cls):
        key = decl.arg if by_arg else decl.field
        if key not in values:
            continue
        value = values[key]
        if decl.spec.parse is not None:
            if by_arg:
                value = decl.spec.parse(value)  # the parser's own error names the argument
        elif not accepts(decl, value, by_arg=by_arg):
            shown = repr(value)
            advice = decl.spec.advice(value) if decl.spec.advice is not None else ""
            raise InvalidEngineArgsError(
                f"{decl.arg}={shown[:80]} is invalid: it must be {decl.describe(by_arg=by_arg)}{advice}.")
        fields[decl.field] = value
    verify_relations = getattr(cls, "verify_relations", None)
    if verify_relations is not None:
        verify_relations({**({} if by_arg else values), **fields})


def accepts(decl: Declaration, value: Any, *, by_arg: bool = True) -> bool:
    """Whether value fits the knob's type (the EngineArgs one with by_arg) and bounds."""
    if not _fits(decl.arg_type if by_arg else decl.type, value):
        return False
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return True
    spec = decl.spec
    if ((spec.ge is not None and not value >= spec.ge) or (spec.gt is not None and not value > spec.gt)
            or (spec.le is not None and not value <= spec.le) or (spec.lt is not None and not value < spec.lt)):
        return False
    return not (spec.power_of_two and isinstance(value, int) and value & (value - 1))


def _union_args(hint: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(hint) in (Union, types.UnionType):
        return typing.get_args(hint)
    return None


def _literal_of(hint: Any) -> list[Any] | None:
    """The Literal values of a hint (a Literal, or a union holding one), else None."""
    if typing.get_origin(hint) is Literal:
        return list(typing.get_args(hint))
    parts = _union_args(hint)
    if parts is None:
        return None
    values = [v for part in parts for v in (_literal_of(part) or [])]
    if not values:
        return None
    if type(None) in parts:
        values.insert(0, None)
    return values


def _fits(hint: Any, value: Any) -> bool:
    parts = _union_args(hint)
    if parts is not None:
        return any(_fits(part, value) for part in parts)
    if hint is type(None):
        return value is None
    if typing.get_origin(hint) is Literal:
        # by type too: True == 1 and 1.0 == 1, but neither is the choice 1
        return any(value == choice and type(value) is type(choice) for choice in typing.get_args(hint))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool) and -_INT64 <= value < _INT64
    if hint is float:
        return (isinstance(value, float) and math.isfinite(value)) or (
            isinstance(value, int) and not isinstance(value, bool))
    if hint is str:
        return isinstance(value, str)
    return True  # Any and structured types: their parse or relations check them


def _fmt(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() and abs(bound) < 2**53 else repr(bound)


def _describe(hint: Any, spec: Knob) -> str:
    literal = _literal_of(hint)
    if literal is not None:
        return "one of " + ", ".join(repr(v) for v in literal)
    parts = _union_args(hint) or (hint,)
    optional = type(None) in parts
    base = next((p for p in parts if p is not type(None)), Any)
    if base is bool:
        text = "True or False"
    elif base in (int, float):
        text = "an integer" if base is int else "a finite number"
        bounds = [f"{op} {_fmt(b)}" for op, b in ((">=", spec.ge), (">", spec.gt), ("<=", spec.le), ("<", spec.lt))
                  if b is not None]
        if bounds:
            text += " " + " and ".join(bounds)
        if spec.power_of_two:
            text += ", a power of two"
    elif base is str:
        text = "a str"
    else:
        text = "a valid value"
    return text + (", or None" if optional else "")


def json_object_arg(value: Any, name: str, allowed: Iterable[str]) -> dict[str, Any]:
    """A structured engine argument given as a dict or a JSON object string (vLLM's flags take
    JSON), with every key one of `allowed`; InvalidEngineArgsError naming `name` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise InvalidEngineArgsError(f"{name} is not valid JSON: {error}.") from None
    if not isinstance(value, dict):
        raise InvalidEngineArgsError(f"{name} must be a dict or a JSON object string, got {type(value).__name__}.")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise InvalidEngineArgsError(f"{name} has unknown key(s) {unknown}; allowed: {sorted(allowed)}.")
    return value
