"""SpeculativeConfig: speculative decoding with model-free proposers (vLLM's speculative_config).

A proposer guesses the next tokens of a decoding request from its own tokens (the prompt and
the output so far); the model verifies every guess in one forward and keeps the longest prefix
the target accepts, plus one token of its own (lm_console/engine/core/spec_decode/,
lm_console/engine/sample/rejection_sampler.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from lm_console.engine.config.fields import json_object_arg
from lm_console.engine.errors import InvalidEngineArgsError

SpeculativeMethod = Literal["ngram", "suffix"]
SPECULATIVE_METHODS: tuple[str, ...] = ("ngram", "suffix")
# Proposals per step: beyond this, a miss wastes more forward rows than a CPU step can hide.
MAX_SPECULATIVE_TOKENS = 16
# The longest n-gram an "ngram" proposer looks up (its search costs O(context x n)).
MAX_PROMPT_LOOKUP = 64
# disable_by_batch_size "auto" on the CPU: verification rows per step (requests x (drafts + 1))
# past which a step is compute-bound and drafts stop paying (for_device).
CPU_VERIFY_ROWS = 96


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings (vLLM's field names).

    method: "ngram" (prompt lookup: the last n tokens, n from prompt_lookup_max down to
    prompt_lookup_min, are looked up in the request's earlier tokens and what followed them is
    proposed) or "suffix" (the longest suffix of the request's tokens that occurred before,
    found in a suffix automaton kept per request; matches of at least prompt_lookup_min tokens).
    num_speculative_tokens: tokens proposed (and verified) per step and request.
    disable_by_batch_size: no proposals while this many requests or more are running (a large
    batch already fills the forward; None: always propose). "auto" (the default) is resolved
    for the device when the engine's config is made (`for_device`).
    """

    method: SpeculativeMethod = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | Literal["auto"] | None = "auto"

    def __post_init__(self) -> None:
        def fail(name: str, allowed: str) -> None:
            raise InvalidEngineArgsError(
                f"speculative_config: {name}={getattr(self, name)!r} is invalid: {allowed}.")

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if self.method not in SPECULATIVE_METHODS:
            fail("method", f"allowed: {', '.join(SPECULATIVE_METHODS)} (model-free proposers; no draft model, "
                           "EAGLE or MTP here)")
        if not is_int(self.num_speculative_tokens) or not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            fail("num_speculative_tokens", f"it must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 1 <= value <= MAX_PROMPT_LOOKUP):
                fail(name, f"it must be an integer in [1, {MAX_PROMPT_LOOKUP}] or None")
        # As vLLM: one bound given sets the other; none gives the defaults.
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low, high = 2, 5
        elif low is None:
            low = min(2, high)  # type: ignore[type-var]
        elif high is None:
            high = max(5, low)
        assert low is not None and high is not None
        if low > high:
            raise InvalidEngineArgsError(
                f"speculative_config: prompt_lookup_min={low} is above prompt_lookup_max={high}.")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        limit = self.disable_by_batch_size
        if limit is not None and limit != "auto" and not (isinstance(limit, int) and is_int(limit) and limit >= 2):
            fail("disable_by_batch_size", "it must be an integer >= 2, 'auto', or None to always propose")

    def for_device(self, device: str) -> SpeculativeConfig:
        """This config with disable_by_batch_size "auto" resolved for `device`.

        On the CPU a verification step reads the weights once, as a plain step does, but computes
        num_speculative_tokens + 1 rows per request: once a batch's rows make the step
        compute-bound, drafts only add work. The 2-core Sapphire Rapids VM measured, with 4
        drafts and a copy workload, 1.12-1.15x at 16 requests and 0.95-0.99x at 32; "auto" stops
        proposing from CPU_VERIFY_ROWS / (num_speculative_tokens + 1) running requests (19 for 4
        drafts). GPUs keep proposing at any batch (None), as vLLM does.
        """
        if self.disable_by_batch_size != "auto":
            return self
        limit = max(2, CPU_VERIFY_ROWS // (self.num_speculative_tokens + 1)) if device == "cpu" else None
        return replace(self, disable_by_batch_size=limit)

    @property
    def batch_limit(self) -> int | None:
        """Running requests from which no drafts are made (None: none; an "auto" that was never
        resolved for a device, as in a Scheduler built by hand, sets no limit)."""
        limit = self.disable_by_batch_size
        return None if limit == "auto" else limit

    @property
    def min_match(self) -> int:
        """prompt_lookup_min, resolved."""
        assert self.prompt_lookup_min is not None
        return self.prompt_lookup_min

    @property
    def max_match(self) -> int:
        """prompt_lookup_max, resolved."""
        assert self.prompt_lookup_max is not None
        return self.prompt_lookup_max

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A SpeculativeConfig from a dict or a JSON object string (None: no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object_arg(value, "speculative_config", {f.name for f in fields(cls)} | {"model"})
        if "model" in value:
            raise InvalidEngineArgsError(
                "speculative_config: 'model' (a draft model) is not supported; use method 'ngram' or 'suffix'.")
        if "method" not in value:
            raise InvalidEngineArgsError("speculative_config needs a 'method': 'ngram' or 'suffix'.")
        return cls(**value)
