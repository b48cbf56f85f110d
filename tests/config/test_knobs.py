"""Each engine knob is declared once, on its config class, and EngineArgs, its checks and the
`lmc` flags all follow that declaration (lm_console/engine/config/fields.py, knobs.py,
lm_console/engine_options.py)."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
import typing
from typing import Any

import pytest
import typer

from lm_console.engine.config import EngineArgs
from lm_console.engine.config.ec_transfer import ECTransferConfig
from lm_console.engine.config.fields import Declaration, Knob, accepts, declarations, verify_values
from lm_console.engine.config.kv_transfer import KVTransferConfig
from lm_console.engine.config.speculative import SpeculativeConfig
from lm_console.engine.config.knobs import ENGINE_ARG_SOURCES, collect, engine_arg_declarations
from lm_console.engine.errors import InvalidEngineArgsError

DECLS = engine_arg_declarations()


def _base(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is not typing.Literal and args else hint


def refused_values(decl: Declaration) -> list[Any]:
    """Values the knob's declaration must refuse: off its Literal, past each bound, of a wrong type."""
    spec, hint = decl.spec, decl.arg_type
    if decl.spec.parse is not None:
        return [42, "{not json"]
    if decl.choices is not None:
        return ["no-such-choice", 1.5]
    base = _base(hint)
    bad: list[Any] = []
    if base is bool:
        return [1, "yes", None]
    if base in (int, float):
        step = 1 if base is int else 1e-6
        if spec.ge is not None:
            bad.append(base(spec.ge) - step)
        if spec.gt is not None:
            bad.append(base(spec.gt))
        if spec.le is not None:
            bad.append(base(spec.le) + step)
        if spec.lt is not None:
            bad.append(base(spec.lt))
        if spec.power_of_two:
            bad.append(24)
        bad += [True, "3"] + ([math.nan, math.inf] if base is float else [1.5, 2**63])
        if type(None) not in typing.get_args(hint):
            bad.append(None)
        return bad
    if base is str:
        return [3, b"bytes"]
    raise AssertionError(f"{decl.arg}: no refused values known for {hint!r}; extend refused_values")


def test_every_engine_args_field_is_one_declaration_and_back() -> None:
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    assert list(fields) == list(DECLS)  # the same names, in the declarations' order
    for name, decl in DECLS.items():
        assert fields[name].type == decl.arg_type, name
        default = (fields[name].default_factory() if fields[name].default_factory is not dataclasses.MISSING
                   else fields[name].default)
        assert default == decl.default_value(), name
    # each declaration sits on exactly one config class, once
    owners = [(d.owner, d.field) for cls in ENGINE_ARG_SOURCES for d in declarations(cls) if d.spec.user]
    assert len(owners) == len(set(owners)) == len(DECLS)
    assert len(DECLS) >= 45  # every knob EngineArgs had before the declarations moved


def test_a_keyword_declared_on_two_classes_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Twice:
        block_size: int = dataclasses.field(default=8, metadata={"lm_console.knob": Knob(help="again")})

    with pytest.raises(ValueError, match="block_size.*declared twice"):
        collect((*ENGINE_ARG_SOURCES, Twice))


def check_refusals(name: str) -> None:
    """AssertionError unless every value the knob's declaration excludes is refused, naming it."""
    for value in refused_values(DECLS[name]):
        try:
            EngineArgs(**{name: value})._verify()
        except InvalidEngineArgsError as error:
            assert name in str(error), (name, value, str(error))
            continue
        raise AssertionError(f"{name}={value!r} was accepted")


@pytest.mark.parametrize("name", sorted(DECLS))
def test_every_knob_refuses_what_its_declaration_excludes(name: str) -> None:
    EngineArgs(**{name: DECLS[name].default_value()})._verify()  # the default passes
    check_refusals(name)


def _engine_filled() -> list[Declaration]:
    """The declared fields the engine (or a connector's JSON) fills: checked, but no keyword."""
    from lm_console.engine.config import ECTransferConfig, KVTransferConfig, StructuredOutputsConfig
    from lm_console.engine.config.cache import CacheConfig

    classes = (CacheConfig, StructuredOutputsConfig, KVTransferConfig, ECTransferConfig)
    return [d for cls in classes for d in declarations(cls) if not d.spec.user]


REQUIRED = {"KVTransferConfig": {"kv_connector": "OffloadConnector"}}


@pytest.mark.parametrize("decl", _engine_filled(), ids=lambda d: f"{d.owner.__name__}.{d.field}")
def test_every_engine_filled_field_refuses_what_its_declaration_excludes(decl: Declaration) -> None:
    required = REQUIRED.get(decl.owner.__name__, {})
    decl.owner(**required, **{decl.field: decl.default_value()})  # the default passes
    for value in refused_values(decl):
        with pytest.raises(InvalidEngineArgsError) as caught:
            decl.owner(**required, **{decl.field: value})
        assert decl.arg in str(caught.value), (decl.arg, value, str(caught.value))


@pytest.mark.parametrize("name", sorted(n for n, d in DECLS.items() if d.choices is not None))
def test_every_choice_is_accepted_and_the_refusal_lists_them(name: str) -> None:
    decl = DECLS[name]
    for choice in decl.choices or ():
        assert accepts(decl, choice), (name, choice)
    with pytest.raises(InvalidEngineArgsError) as caught:
        EngineArgs(**{name: "no-such-choice"})._verify()
    for choice in decl.choices or ():
        assert repr(choice) in str(caught.value)


def test_the_config_classes_check_themselves() -> None:
    from lm_console.engine.config import CacheConfig, ParallelConfig, SchedulerConfig

    with pytest.raises(InvalidEngineArgsError, match="scheduling_policy='lifo'.*'fcfs', 'priority'"):
        SchedulerConfig(policy="lifo")  # type: ignore[arg-type]
    with pytest.raises(InvalidEngineArgsError, match="block_size=12 .*power of two"):
        CacheConfig(block_size=12)
    with pytest.raises(InvalidEngineArgsError, match="data_parallel_rank=2 .*data_parallel_size=2"):
        ParallelConfig(data_parallel_size=2, data_parallel_rank=2)
    with pytest.raises(InvalidEngineArgsError, match="num_blocks=0"):
        CacheConfig(num_blocks=0)  # an engine-filled field is checked like a knob


def test_dtype_names_are_the_platforms() -> None:
    from lm_console.engine.config.model import ModelDType
    from lm_console.engine.platform import _DTYPE_NAMES

    assert set(typing.get_args(ModelDType)) == {"auto", *_DTYPE_NAMES}


# -- negative controls: the checks above must fail on a declaration that lost its rule --------


def _loosened(decl: Declaration, **changes: Any) -> Declaration:
    return dataclasses.replace(decl, spec=dataclasses.replace(decl.spec, **changes))


def _patch(monkeypatch: pytest.MonkeyPatch, loose: Declaration) -> None:
    """The declarations with `loose` in place of its original, as the checks read them."""
    from lm_console.engine.config import fields as fields_module

    patched = tuple(loose if d.field == loose.field else d for d in declarations(loose.owner))
    monkeypatch.setitem(fields_module._DECLARATIONS, loose.owner, patched)


@pytest.mark.parametrize(("name", "changes"), [
    ("max_num_seqs", {"ge": None}),  # the bound dropped
    ("kv_cache_metrics_sample", {"le": None}),
    ("data_parallel_size", {"le": None}),
    ("block_size", {"power_of_two": False}),
])
def test_a_dropped_bound_fails_the_refusal_check(monkeypatch: pytest.MonkeyPatch, name: str,
                                                 changes: dict[str, Any]) -> None:
    decl = DECLS[name]  # check_refusals keeps the intact declaration's refused values
    _patch(monkeypatch, dataclasses.replace(decl, spec=dataclasses.replace(decl.spec, **changes)))
    with pytest.raises(AssertionError, match=f"{name}=.* was accepted"):
        check_refusals(name)


def test_a_literal_widened_to_str_fails_the_refusal_check(monkeypatch: pytest.MonkeyPatch) -> None:
    decl = DECLS["scheduling_policy"]
    _patch(monkeypatch, dataclasses.replace(decl, type=str))
    verify_values(decl.owner, {"scheduling_policy": "lifo"}, by_arg=True)  # no longer refused
    with pytest.raises(AssertionError, match="scheduling_policy='no-such-choice' was accepted"):
        check_refusals("scheduling_policy")


# -- the `lmc` flags ---------------------------------------------------------------------------


def _serve_params() -> dict[str, inspect.Parameter]:
    from lm_console.cli_serve import serve

    return dict(inspect.signature(serve).parameters)


def _flag_default(param: inspect.Parameter) -> Any:
    value = param.default
    return value.value if isinstance(value, enum.Enum) else value


def test_every_flagged_knob_is_a_serve_flag_with_the_knobs_default() -> None:
    from lm_console.engine_options import flag_declarations, param_name

    params = _serve_params()
    # lmc serve's deliberate default (a server prefaults its KV cache: docs/serving.md)
    overrides = {"kv_cache_prefault": True}
    flagged = flag_declarations()
    assert {"max_num_seqs", "num_gpu_blocks_override", "liveness_timeout_s", "model", "block_size",
            "scheduling_policy", "kv_cache_dtype", "data_parallel_backend"} <= set(flagged)
    for name, decl in flagged.items():
        param = params[param_name(decl)]
        expected = overrides.get(name, decl.default_value())
        if expected is None and decl.spec.cli_none is not None:
            expected = decl.spec.cli_none
        assert _flag_default(param) == expected, name
        if decl.choices is not None:  # the flag offers exactly the knob's choices
            (info,) = [m for m in typing.get_args(param.annotation)[1:] if isinstance(m, typer.models.OptionInfo)]
            kind = _base(typing.get_args(param.annotation)[0])  # Optional[Choices] for a knob that may be None
            assert [m.value for m in kind] == [str(c) for c in decl.choices if c is not None], name
            assert info.help == decl.spec.help


def test_the_flags_reach_engine_args_and_bad_values_are_refused() -> None:
    from typer.testing import CliRunner

    from lm_console.cli import app

    serve_cmd = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    params = serve_cmd.make_context("serve", ["--num-blocks", "64", "--scheduling-policy", "priority",
                                              "--liveness-timeout", "0", "--no-enable-prefix-caching"]).params
    assert (params["num_blocks"], params["liveness_timeout"], params["enable_prefix_caching"]) == (64, 0.0, False)
    runner = CliRunner()
    for argv, flag in ((["--scheduling-policy", "lifo"], "--scheduling-policy"), (["--max-num-seqs", "0"],
                       "--max-num-seqs"), (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype")):
        result = runner.invoke(app, ["serve", *argv], env={"COLUMNS": "200"})
        assert result.exit_code == 2 and flag in result.output, (argv, result.output)


def test_engine_kwargs_keep_only_what_differs_from_the_knobs() -> None:
    from lm_console.engine_options import engine_kwargs, serve_flags

    assert engine_kwargs({"max_num_seqs": 128, "block_size": 32, "liveness_timeout_s": 0.0,
                          "async_scheduling": False}) == {"block_size": 32, "liveness_timeout_s": None}
    assert serve_flags({"block_size": 32, "liveness_timeout_s": None, "enable_prefix_caching": False,
                        "num_gpu_blocks_override": 7}) == [
        "--block-size", "32", "--liveness-timeout", "0", "--no-enable-prefix-caching", "--num-blocks", "7"]
    with pytest.raises(ValueError, match="multiprocess has no `lmc serve` flag"):
        serve_flags({"multiprocess": False})


@pytest.mark.parametrize(("name", "parse", "key"), [
    ("kv_transfer_config", KVTransferConfig.parse, "kv_connector"),
    ("ec_transfer_config", ECTransferConfig.from_arg, "ec_connector"),
    ("speculative_config", SpeculativeConfig.parse, "method"),
])
def test_json_object_arguments_name_themselves_in_each_refusal(name: str, parse: Any, key: str) -> None:
    for value, why in (("{not json", "is not valid JSON"), ("[1, 2]", "must be a dict or a JSON object string, got list"),
                       (7, "must be a dict .*, got int"),
                       ({key: "x", "colour": 1}, r"has unknown key\(s\) \['colour'\]; allowed: .*" + key)):
        with pytest.raises(InvalidEngineArgsError, match=f"^{name} {why}"):
            parse(value)


def test_the_speculative_flag_is_refused_before_an_engine_starts() -> None:
    from lm_console.engine_options import speculative_args

    assert speculative_args(None) == {}
    parsed = speculative_args('{"method": "ngram", "num_speculative_tokens": 3}')["speculative_config"]
    assert isinstance(parsed, SpeculativeConfig) and parsed.num_speculative_tokens == 3
    with pytest.raises(typer.BadParameter, match="draft model"):
        speculative_args('{"method": "ngram", "model": "tiny"}')
    with pytest.raises(typer.BadParameter, match="speculative_config is not valid JSON"):
        speculative_args("{ngram")


def test_the_speculative_batch_limit_is_resolved_for_the_device() -> None:
    """disable_by_batch_size "auto" (the default) becomes a number on the CPU and None on a GPU
    when EngineArgs makes the config; a number or None given stays as given."""
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    assert EngineArgs(speculative_config=spec).create_speculative_config("cpu").disable_by_batch_size == 19
    assert EngineArgs(speculative_config=spec).create_speculative_config("cuda").disable_by_batch_size is None
    given = EngineArgs(speculative_config={**spec, "disable_by_batch_size": None}).create_speculative_config("cpu")
    assert given.disable_by_batch_size is None
    assert EngineArgs().create_speculative_config("cpu") is None
