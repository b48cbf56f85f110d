"""SamplingParams and RequestOutputKind (after vLLM's vllm/sampling_params.py)."""

from __future__ import annotations

import enum
import json as _json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lm_console.engine.errors import InvalidSamplingParamsError

_GREEDY_EPSILON = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 256  # completions per request: each is a request in the engine
_DECIMAL_KEY = re.compile(r"-?[0-9]{1,19}")  # a logit_bias key as JSON sends it ("1234")


class RequestOutputKind(enum.IntEnum):
    """How much of the output each RequestOutput carries."""

    CUMULATIVE = 0  # everything generated so far (default)
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output when the request finishes


@dataclass
class StructuredOutputsParams:
    """One output constraint for a request (vLLM's names); exactly one of the first five is set.

    json: a JSON schema (a dict, or its JSON text); json_object: any JSON object; regex: a
    regular expression the whole output matches; choice: the output is one of these strings;
    grammar: an EBNF grammar (GBNF style, its start rule named `root`). disable_any_whitespace:
    JSON without optional whitespace (only the fixed separators ", " and ": "). The engine core compiles the constraint
    (xgrammar); one it cannot compile fails that request with InvalidStructuredOutputError.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Exactly one constraint, each of the right type (InvalidStructuredOutputError otherwise)."""
        from lm_console.engine.errors import InvalidStructuredOutputError

        def fail(message: str) -> None:
            raise InvalidStructuredOutputError(f"StructuredOutputsParams: {message}")

        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object is not None and not isinstance(self.json_object, bool):
            fail(f"json_object={_short_repr(self.json_object)} must be True, False or None.")
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            fail("set exactly one of json, regex, choice, grammar, json_object=True; got "
                 f"{', '.join(given) if given else 'none'}.")
        if not isinstance(self.disable_any_whitespace, bool):
            fail(f"disable_any_whitespace={_short_repr(self.disable_any_whitespace)} must be True or False.")
        if self.json is not None:
            self._verify_json_schema(fail)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or not _is_utf8(value)):
                fail(f"{name}={_short_repr(value)} must be a non-empty string.")
        if self.choice is not None and (
                not isinstance(self.choice, list) or not self.choice
                or any(not isinstance(c, str) or not _is_utf8(c) for c in self.choice)):
            fail(f"choice={_short_repr(self.choice)} must be a non-empty list of strings.")

    def _verify_json_schema(self, fail: Callable[[str], None]) -> None:
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = _json.loads(schema)
            except ValueError as error:
                fail(f"json is not valid JSON text ({error}); pass a JSON schema as a dict or its JSON text.")
        if not isinstance(schema, dict):
            fail(f"json={_short_repr(self.json)} must be a JSON schema object (a dict or its JSON text).")
        try:
            _json.dumps(schema)
        except (TypeError, ValueError) as error:
            fail(f"json schema is not JSON-serialisable: {error}.")

    @property
    def kind(self) -> str:
        """Which constraint is set: json | json_object | regex | choice | grammar."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def grammar_key(self) -> tuple[str, str]:
        """(kind, spec): what the grammar compiler compiles, and the key of its cache."""
        kind = self.kind
        if kind == "json":
            spec = self.json if isinstance(self.json, str) else _json.dumps(self.json, sort_keys=True)
        elif kind == "choice":
            spec = _json.dumps(self.choice)
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(self, kind)
        if kind in ("json", "json_object") and self.disable_any_whitespace:
            kind += ":compact"
        return kind, spec


POOLING_TYPES = ("LAST", "MEAN")


@dataclass
class PoolingParams:
    """Ask for the prompt's embedding instead of text (vLLM's pooler config names).

    pooling_type: LAST (the last prompt token's final hidden state, before the LM head) or MEAN
    (the average over all prompt tokens); normalize: L2-normalise the vector.
    """

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.pooling_type, str):
            self.pooling_type = self.pooling_type.upper()
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidSamplingParamsError(f"PoolingParams.pooling_type={_short_repr(self.pooling_type)} is "
                                             f"invalid: use one of {', '.join(POOLING_TYPES)}.")
        if not isinstance(self.normalize, bool):
            raise InvalidSamplingParamsError(f"PoolingParams.normalize={_short_repr(self.normalize)} is invalid: "
                                             "normalize must be True or False.")


@dataclass
class SamplingParams:
    """Per-request sampling settings, validated in __post_init__ (vLLM-compatible fields).

    Mutable like vLLM's, but a field changed after construction is validated again when the
    request is submitted (the InputProcessor verifies its own copy).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrained decoding (lm_console/engine/structured_output/): JSON schema, regex, choice, grammar.
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> value added to its logit before sampling, in [-100, 100] (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # Sampling picks only among these ids (every other logit is -inf); None: no restriction.
    allowed_token_ids: list[int] | None = None
    # Free-form per-request extras; "kv_transfer_params" reaches the KV connector (P/D).
    extra_args: dict[str, Any] | None = None
    # An embedding request (LLM.embed, /v1/embeddings): the output carries the pooled prompt.
    pooling: PoolingParams | None = None
    # Filled by the InputProcessor from the tokenizer; not user-facing.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        self.verify()

    @property
    def needs_every_prompt_token(self) -> bool:
        """Whether no prompt token may be skipped (prefix cache hits, KV loads): prompt logprobs
        and MEAN pooling read every prompt position's hidden state."""
        return self.prompt_logprobs is not None or (self.pooling is not None and self.pooling.pooling_type == "MEAN")

    def verify(self) -> None:
        """Normalise and validate every field (InvalidSamplingParamsError names the first bad one).

        Runs at construction, again on the copy the InputProcessor takes at submission (so a
        field changed after construction is caught), and in the engine core when msgspec
        decodes the request. The types are exactly those the core's typed decode accepts.
        """
        self._normalize()
        self._verify()

    def _normalize(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as error:
                raise InvalidSamplingParamsError(
                    f"SamplingParams.structured_outputs: {error}; allowed keys: json, regex, choice, "
                    "grammar, json_object, disable_any_whitespace.") from None
        if isinstance(self.logit_bias, dict):
            # String keys are how JSON carries ids (OpenAI's field): read them as ints here.
            normalized: dict[Any, Any] = {}
            for key, value in self.logit_bias.items():
                if isinstance(key, str) and _DECIMAL_KEY.fullmatch(key):
                    key = int(key)
                normalized[key] = float(value) if _is_int(value) else value
            self.logit_bias = normalized or None
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if _is_int(self.top_k) and self.top_k == 0:
            self.top_k = -1
        if isinstance(self.all_stop_token_ids, (set, frozenset, list, tuple)) and isinstance(self.stop_token_ids, list):
            # A union, not a reset: msgspec calls __post_init__ when a request is decoded in the
            # engine core, and the InputProcessor's EOS ids must survive the trip.
            try:
                self.all_stop_token_ids = set(self.all_stop_token_ids) | set(self.stop_token_ids)
            except TypeError:
                pass  # an unhashable id: _verify names it

    def _verify(self) -> None:
        def fail(name: str, value: object, allowed: str) -> None:
            raise InvalidSamplingParamsError(
                f"SamplingParams.{name}={_short_repr(value)} is invalid: {allowed}.")

        def check_int(name: str, low: int, allowed: str, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            if not _is_int(value) or value < low:
                fail(name, value, allowed)

        def check_float(name: str, ok: Callable[[float], bool], allowed: str) -> None:
            value = getattr(self, name)
            if not _is_number(value) or not ok(value):
                fail(name, value, allowed)

        check_int("n", 1, f"n must be an integer in [1, {MAX_N}]")
        if self.n > MAX_N:
            fail("n", self.n, f"n must be an integer in [1, {MAX_N}]")
        check_float("temperature", lambda v: v >= 0, "temperature must be a finite number >= 0 (0 means greedy)")
        check_float("top_p", lambda v: 0.0 < v <= 1.0, "top_p must be a number in (0, 1]")
        check_int("top_k", -1, "top_k must be an integer >= -1 (-1 or 0 disables it)")
        check_float("min_p", lambda v: 0.0 <= v <= 1.0, "min_p must be a number in [0, 1]")
        check_float("repetition_penalty", lambda v: v > 0, "repetition_penalty must be a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            check_float(name, lambda v: -2.0 <= v <= 2.0, f"{name} must be a number in [-2, 2]")
        if self.seed is not None and not _is_int(self.seed):
            fail("seed", self.seed, f"seed must be an integer in [{INT64_MIN}, {INT64_MAX}] or None")
        check_int("max_tokens", 1, "max_tokens must be an integer >= 1 or None", optional=True)
        check_int("min_tokens", 0, "min_tokens must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", self.min_tokens, f"min_tokens must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            check_int(name, 0, f"{name} must be an integer >= 0 or None", optional=True)
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s or not _is_utf8(s)
                                                  for s in self.stop):
            fail("stop", self.stop, "stop must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", self.stop_token_ids, "stop_token_ids must be a list of integers >= 0")
        if (not isinstance(self.all_stop_token_ids, set)
                or any(not _is_int(t) or t < 0 for t in self.all_stop_token_ids)):
            fail("all_stop_token_ids", self.all_stop_token_ids, "all_stop_token_ids must be a set of integers >= 0")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                fail(name, getattr(self, name), f"{name} must be True or False")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(not _is_int(k) or k < 0 for k in self.logit_bias):
                fail("logit_bias", self.logit_bias, "logit_bias must map token ids (integers >= 0) to biases")
            bad = [k for k, v in self.logit_bias.items() if not _is_number(v) or not -100.0 <= v <= 100.0]
            if bad:
                fail("logit_bias", {k: self.logit_bias[k] for k in bad[:5]},
                     "each bias must be a number in [-100, 100]")
        if self.allowed_token_ids is not None:
            if (not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                    or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)):
                fail("allowed_token_ids", self.allowed_token_ids,
                     "allowed_token_ids must be None or a non-empty list of token ids (integers >= 0)")
        if self.extra_args is not None:
            if not isinstance(self.extra_args, dict) or any(not isinstance(k, str) or not _is_utf8(k)
                                                            for k in self.extra_args):
                fail("extra_args", self.extra_args, "extra_args must be None or a dict with str keys")
            kv_params = self.extra_args.get("kv_transfer_params")
            if kv_params is not None and not (isinstance(kv_params, dict)
                                              and all(isinstance(k, str) for k in kv_params)):
                fail("extra_args", self.extra_args, "extra_args['kv_transfer_params'] must be a dict with str keys")
        if self.pooling is not None:
            if isinstance(self.pooling, dict):
                self.pooling = PoolingParams(**self.pooling)
            if not isinstance(self.pooling, PoolingParams):
                fail("pooling", self.pooling, "pooling must be a PoolingParams or None")
            self.pooling.__post_init__()
            if self.max_tokens != 1 or self.n != 1 or self.structured_outputs is not None:
                fail("pooling", self.pooling, "a pooling request runs its prompt only: max_tokens=1, n=1 and no "
                                              "structured_outputs")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                fail("structured_outputs", self.structured_outputs,
                     "structured_outputs must be a StructuredOutputsParams (or a dict of its fields) or None")
            self.structured_outputs.verify()
            choices = self.structured_outputs.choice
            if choices and self.min_tokens > 0:
                # A choice ends the output once it is complete: at most one token per byte of the
                # longest choice before the stop token, which min_tokens masks until that many
                # tokens are out. More is a request that cannot be met (the grammar would then
                # allow only the masked stop token).
                most = max(len(choice.encode("utf-8")) for choice in choices)
                if self.min_tokens > most:
                    fail("min_tokens", self.min_tokens,
                         f"with a choice constraint at most {most} tokens come before the stop token (one per "
                         f"byte of its longest choice), so min_tokens must be <= {most}")
        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", self.output_kind, "output_kind must be a RequestOutputKind")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    def clone(self) -> SamplingParams:
        """A copy with its own lists (n > 1 children get one each)."""
        import copy

        try:
            clone = copy.copy(self)
            # Fresh containers (the only mutable fields); extra_args may nest, so it is copied deeply.
            for name in ("stop", "stop_token_ids", "all_stop_token_ids", "logit_bias", "allowed_token_ids"):
                value = getattr(self, name)
                if isinstance(value, (list, set, dict)):
                    setattr(clone, name, type(value)(value))
            if self.extra_args is not None:
                clone.extra_args = copy.deepcopy(self.extra_args)
            if self.structured_outputs is not None:
                clone.structured_outputs = copy.deepcopy(self.structured_outputs)
            return clone
        except Exception as error:  # noqa: BLE001 - e.g. an uncopyable object in extra_args
            raise InvalidSamplingParamsError(
                f"SamplingParams cannot be copied ({type(error).__name__}: {error}): every field must "
                "hold plain values (numbers, strings, lists, dicts).") from None


def _is_int(value: object) -> bool:
    """An int the engine core decodes as one: not a bool, within the signed 64-bit range."""
    return isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX


def _is_number(value: object) -> bool:
    """A finite int or float (bool is not a number here)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return INT64_MIN <= value <= INT64_MAX
    return isinstance(value, float) and math.isfinite(value)


def _is_utf8(text: str) -> bool:
    """False for strings with lone surrogates (e.g. undecodable bytes from argv), which msgpack cannot carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _short_repr(value: object, limit: int = 80) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."
