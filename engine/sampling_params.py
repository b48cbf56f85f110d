"""SamplingParams and RequestOutputKind (seed: InputProcessor, lines 1986-2057)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidSamplingParamsError

_GREEDY_EPSILON = 1e-5


class RequestOutputKind(enum.IntEnum):
    """How much of the output each RequestOutput carries."""

    CUMULATIVE = 0  # everything generated so far (default)
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output when the request finishes


@dataclass
class SamplingParams:
    """Per-request sampling settings, validated in __post_init__ (vLLM-compatible fields)."""

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
    # Free-form per-request extras; "kv_transfer_params" reaches the KV connector (P/D).
    extra_args: dict[str, Any] | None = None
    # Filled by the InputProcessor from the tokenizer; not user-facing.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop) if self.stop else []
        self.stop_token_ids = list(self.stop_token_ids) if self.stop_token_ids else []
        if self.top_k == 0:
            self.top_k = -1
        self._verify()
        # A union, not a reset: msgspec calls __post_init__ when a request is decoded in the
        # engine core, and the InputProcessor's EOS ids must survive the trip.
        self.all_stop_token_ids = set(self.all_stop_token_ids) | set(self.stop_token_ids)

    def _verify(self) -> None:
        def fail(name: str, value: object, allowed: str) -> None:
            raise InvalidSamplingParamsError(f"SamplingParams.{name}={value!r} is invalid: {allowed}.")

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            fail("n", self.n, "n must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            fail("temperature", self.temperature, "temperature must be a number >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            fail("top_p", self.top_p, "top_p must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            fail("top_k", self.top_k, "top_k must be an integer >= -1 (-1 or 0 disables it)")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", self.min_p, "min_p must be in [0, 1]")
        if not isinstance(self.repetition_penalty, (int, float)) or self.repetition_penalty <= 0:
            fail("repetition_penalty", self.repetition_penalty, "repetition_penalty must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                fail(name, value, f"{name} must be in [-2, 2]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            fail("seed", self.seed, "seed must be an integer or None")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1
        ):
            fail("max_tokens", self.max_tokens, "max_tokens must be an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", self.min_tokens, "min_tokens must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", self.min_tokens, f"min_tokens must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                fail(name, value, f"{name} must be an integer >= 0 or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", self.stop, "stop must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", self.stop_token_ids, "stop_token_ids must be non-negative integers")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            fail("extra_args", self.extra_args, "extra_args must be a dict or None")
        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", self.output_kind, "output_kind must be a RequestOutputKind")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    def clone(self) -> SamplingParams:
        """A copy with its own lists (n > 1 children get one each)."""
        import copy

        return copy.deepcopy(self)
