"""Request and response models of the OpenAI API as vLLM serves it (completions, models, tokenizer).

Field names, defaults and meanings follow vLLM's protocol (OpenAI's fields, then vLLM's extras
such as top_k, min_p, ignore_eos). An unknown field is ignored with a warning in the server's log,
as vLLM does (clients send fields of newer API versions and of other servers). A known field the
engine cannot honour is refused with 400 naming it, unless it holds its do-nothing value, so that
nothing the engine knows of is accepted silently. Requests parse in pydantic's strict mode: "5" is
not an integer and true is not 1. The chat models are in protocol_chat.py.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ModelWrapValidatorHandler, model_validator

from lm_console.engine.entrypoints.openai.errors import bad_request, model_not_found, unsupported

logger = logging.getLogger(__name__)

INT64_MIN = -(2**63)
# Unknown field names a warning lists (and the characters of each): a client's typo is shown, a
# hostile body with thousands of keys does not flood the log.
MAX_IGNORED_FIELDS_LOGGED = 10
MAX_IGNORED_NAME_CHARS = 64
INT64_MAX = 2**63 - 1

TokenId = Annotated[int, Field(ge=0)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class IgnoredFields:
    """The unknown fields of one request body, for one warning line (bounded, whatever the body)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.count = 0

    def add(self, model_name: str, keys: list[Any]) -> None:
        self.count += len(keys)
        for key in keys[:MAX_IGNORED_FIELDS_LOGGED - len(self.names)]:
            name = repr(str(key)[:MAX_IGNORED_NAME_CHARS])
            self.names.append(name if model_name in _TOP_LEVEL_MODELS else f"{name} (in {model_name})")

    def log(self) -> None:
        if self.count:
            more = f" and {self.count - len(self.names)} more" if self.count > len(self.names) else ""
            logger.warning("The following fields were present in the request but ignored: %s%s.",
                           ", ".join(self.names), more)


_ignored_fields: ContextVar[IgnoredFields | None] = ContextVar("lmc_ignored_fields", default=None)
_TOP_LEVEL_MODELS = frozenset({"CompletionRequest", "ChatCompletionRequest", "TokenizeCompletionRequest",
                               "TokenizeChatRequest", "DetokenizeRequest"})


@contextlib.contextmanager
def collect_ignored_fields() -> Iterator[IgnoredFields]:
    """Collect the unknown fields of the bodies validated inside, then log them as one warning."""
    collector = IgnoredFields()
    token = _ignored_fields.set(collector)
    try:
        yield collector
    finally:
        _ignored_fields.reset(token)
    collector.log()


class RequestModel(BaseModel):
    """A request body: strict types, unknown fields ignored with a warning, do-nothing-only extras checked."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored_fields(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        if isinstance(data, dict):
            ignored = [key for key in data if key not in cls.model_fields]
            if ignored:
                collector = _ignored_fields.get()
                if collector is None:  # validated outside collect_ignored_fields(): say it at once
                    collector = IgnoredFields()
                    collector.add(cls.__name__, ignored)
                    collector.log()
                else:
                    collector.add(cls.__name__, ignored)
        return handler(data)

    # field -> (its do-nothing values, why the engine cannot honour anything else)
    UNSUPPORTED: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {}

    def refuse_unsupported(self) -> None:
        """Raise 400 for the first field that asks for a feature this engine lacks."""
        for name, (neutral, why) in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if value is not None and not any(value == n and type(value) is type(n) for n in neutral):
                raise unsupported(name, why)


class ResponseModel(BaseModel):
    """A response body (built by the server, so no validation settings are needed)."""


class StreamOptions(RequestModel):
    """A stream's usage: a last chunk with it only when include_usage is true (OpenAI's meaning: not
    asked, not sent), and with continuous_usage_stats every chunk carries the usage so far too."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = False


class PromptTokenUsageInfo(ResponseModel):
    cached_tokens: int | None = None


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached_tokens))


class ModelPermission(ResponseModel):
    id: str = Field(default_factory=lambda: random_id("modelperm"))
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(ResponseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "lm-console"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(ResponseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


# Shared by /v1/completions and /v1/chat/completions: vLLM's extras this engine lacks.
SAMPLING_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "bad_words": (([],), "the sampler has no bad-words filter"),
    "kv_transfer_params": ((), "pass KV transfer parameters through the Python API"),
    "vllm_xargs": ((), "no custom extensions are installed"),
}


class SamplingFields(RequestModel):
    """The sampling fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    n: int = 1
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None  # an end-user id for the caller's own logs; it changes no output
    # vLLM's sampling extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: max_model_len - 1
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    # Output constraints (structured_outputs.py): OpenAI's, vLLM's, vLLM's legacy guided_*.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias in [-100, 100]
    allowed_token_ids: list[TokenId] | None = None
    prompt_logprobs: int | None = None
    use_beam_search: bool | None = None  # n beams, n results (frontend beam search over one-token steps)
    length_penalty: float | None = None  # beam search's score: cumulative logprob / length ** length_penalty
    # Known fields the engine cannot honour (see SAMPLING_UNSUPPORTED).
    bad_words: list[str] | None = None
    priority: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = SAMPLING_UNSUPPORTED

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_common(self, max_stop_strings: int, max_n: int) -> None:
        """vLLM's cross-field checks plus this server's size limits (400 on failure)."""
        self.refuse_unsupported()
        self.check_beam_search()
        if self.stream_options is not None and not self.stream:
            raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
        stops = self.stop_list
        if len(stops) > max_stop_strings:
            raise bad_request(f"stop has {len(stops)} strings; at most {max_stop_strings} are allowed.", "stop")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > max_stop_strings:
            raise bad_request(f"stop_token_ids has {len(self.stop_token_ids)} ids; at most "
                              f"{max_stop_strings} are allowed.", "stop_token_ids")
        if self.n > max_n:
            raise bad_request(f"n={self.n} is too large: at most {max_n} completions per request.", "n")
        if self.prompt_logprobs is not None and self.stream:  # vLLM's rule
            raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if self.seed is not None and self.n > 1 and self.seed + self.n - 1 > INT64_MAX:
            raise bad_request("seed + n - 1 must fit in int64 (choice i samples with seed + i).", "seed")

    # With use_beam_search, the fields that hold anything but these values are refused: beam search
    # ranks beams by the model's own log-probabilities, so a sampling control would do nothing.
    BEAM_SEARCH_NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        "temperature": (None, 0, 0.0, 1, 1.0), "top_p": (None, 1, 1.0), "top_k": (None, -1, 0), "min_p": (None, 0, 0.0),
        "repetition_penalty": (None, 1, 1.0), "presence_penalty": (None, 0, 0.0),
        "frequency_penalty": (None, 0, 0.0), "stop": (None, "", []), "stop_token_ids": (None, []),
        "min_tokens": (0,), "logit_bias": (None, {}),
        "allowed_token_ids": (None,), "prompt_logprobs": (None,), "response_format": (None, {"type": "text"}),
        "structured_outputs": (None,), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
        "guided_grammar": (None,),
    }

    def check_beam_search(self) -> None:
        """400 for a field that beam search would not honour (only with use_beam_search)."""
        if not self.use_beam_search:
            if self.length_penalty is not None and self.length_penalty != 1.0:
                raise bad_request("length_penalty applies to beam search only: set use_beam_search to true.",
                                  "length_penalty")
            return
        for name, neutral in self.BEAM_SEARCH_NEUTRAL.items():
            value = getattr(self, name)
            if not any(value == n and type(value) is type(n) for n in neutral):
                raise bad_request(f"'{name}' cannot be used with use_beam_search: beam search keeps the n most "
                                  "likely sequences by the model's own log-probabilities.", name)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: list[TokenId] | list[list[TokenId]] | str | list[str] | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    UNSUPPORTED: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {
        **SAMPLING_UNSUPPORTED,
        "suffix": (("",), "the engine has no fill-in-the-middle mode"),
        "best_of": ((1,), "best_of > 1 needs beam-style candidate ranking, which the engine lacks; use n"),
    }

    def check(self, max_logprobs: int, max_stop_strings: int, max_n: int, max_prompts: int) -> None:
        """Every check that needs no engine (400 on failure)."""
        self.check_common(max_stop_strings, max_n)
        if self.prompt is None or self.prompt == "" or self.prompt == []:
            raise bad_request("prompt must be provided and non-empty.", "prompt")
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            if len(self.prompt) > max_prompts:
                raise bad_request(f"prompt has {len(self.prompt)} prompts; at most {max_prompts} per request.",
                                  "prompt")
            if any(not p for p in self.prompt):  # type: ignore[union-attr]
                raise bad_request("every prompt in the list must be non-empty.", "prompt")
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            raise bad_request(f"logprobs must be in [0, {max_logprobs}], got {self.logprobs}.", "logprobs")
        if self.max_tokens is None:
            self.max_tokens = 16  # vLLM's normalisation of null

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: one text or one token-id list each."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        assert prompt is not None
        if prompt and isinstance(prompt[0], int):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class CompletionLogProbs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(ResponseModel):
    """vLLM's Logprob in prompt_logprobs: the value, its 1-based rank, the token's text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]  # one per prompt token; the first is None


def prompt_logprobs_json(rows: list[Any] | None) -> PromptLogprobs | None:
    """RequestOutput.prompt_logprobs as vLLM's response field (logprobs below -9999 clamped)."""
    if rows is None:
        return None
    return [None if row is None else {
        tid: PromptLogprob(logprob=max(lp.logprob, -9999.0), rank=lp.rank, decoded_token=lp.decoded_token)
        for tid, lp in row.items()} for row in rows]


class CompletionResponseChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionResponseStreamChoice(CompletionResponseChoice):
    """A streamed choice: text is the delta since the last chunk."""


class CompletionStreamResponse(ResponseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class TokenizeCompletionRequest(RequestModel):
    """POST /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class DetokenizeRequest(RequestModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str


def check_model(requested: str | None, served: list[str]) -> str:
    """The model name to answer with; 404 when the request names another model."""
    if requested is None or requested in served:
        return requested or served[0]
    raise model_not_found(requested, served)


__all__ = [
    "CompletionLogProbs", "CompletionRequest", "CompletionResponse", "CompletionResponseChoice",
    "CompletionResponseStreamChoice", "CompletionStreamResponse", "DetokenizeRequest", "DetokenizeResponse",
    "ModelCard", "ModelList", "RequestModel", "ResponseModel", "SamplingFields",
    "SAMPLING_UNSUPPORTED", "StreamOptions", "TokenizeCompletionRequest", "TokenizeResponse", "UsageInfo",
    "check_model", "make_usage", "random_id",
]
