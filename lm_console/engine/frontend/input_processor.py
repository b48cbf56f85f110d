"""InputProcessor: validate and tokenize a prompt into an EngineCoreRequest."""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import msgspec

from lm_console.engine.admission import check_decodable, check_request_id
from lm_console.engine.errors import (
    InvalidLoRARequestError,
    InvalidPriorityError, InvalidPromptError, InvalidSamplingParamsError, MultiModalNotSupportedError,
    TooManyMultiModalItemsError,
)
from lm_console.engine.frontend.prompt_length import max_prompt_chars
from lm_console.engine.lora.admission import LoRAAdmission
from lm_console.engine.lora.request import LoRARequest
from lm_console.engine.multimodal.processing import MultiModalProcessor
from lm_console.engine.protocol import EngineCoreRequest
from lm_console.engine.sampling_params import SamplingParams

PromptType = Union[str, dict[str, Any]]

if TYPE_CHECKING:
    from lm_console.engine.config.engine_config import EngineConfig
    from lm_console.engine.frontend.output_processor import ParentRequest
    from lm_console.engine.multimodal.inputs import MultiModalFeatureSpec

# (prompt text, request, parent when n > 1, child index)
ChildRequest = tuple[Union[str, None], EngineCoreRequest, "ParentRequest | None", int]


# The keys a prompt dict may have (vLLM's TextPrompt / TokensPrompt); anything else is refused.
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data", "multi_modal_uuids", "mm_uuids",
                         "mm_processor_kwargs", "cache_salt"})


class InputProcessor:
    """Turns user prompts into EngineCoreRequests; every check runs before the engine sees it.

    Admission is type-safe: each request is checked against exactly what the engine core's
    typed decode accepts (lm_console/engine/admission.py), so a request the core would refuse fails here
    with its own error and never reaches the core.
    """

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int,
                 eos_token_id: int | None, extra_stop_token_ids: set[int] | None = None,
                 mm_processor: MultiModalProcessor | None = None, max_logprobs: int = 20,
                 scheduling_policy: str = "fcfs", lora: LoRAAdmission | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.extra_stop_token_ids = extra_stop_token_ids or set()
        self.mm_processor = mm_processor  # None: a text-only model
        self.max_logprobs = max_logprobs  # -1: no limit
        self.scheduling_policy = scheduling_policy  # "fcfs" refuses any priority but 0 (as vLLM)
        self.lora = lora  # None: every LoRARequest is refused (LoRA not enabled)
        # Texts longer than this cannot fit max_model_len tokens: refused untokenised.
        self.max_prompt_chars = max_prompt_chars(tokenizer, max_model_len) if tokenizer is not None else None

    # -- prompts ----------------------------------------------------------------------------
    def check_prompt_text(self, text: object, what: str = "prompt") -> str:
        """The text if it can be tokenised and might fit max_model_len; InvalidPromptError otherwise."""
        if not isinstance(text, str):
            raise InvalidPromptError(f"{what} must be a str, got {type(text).__name__}.")
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise InvalidPromptError(
                f"The {what} has {len(text)} characters: more than max_model_len={self.max_model_len} tokens "
                f"can hold with this tokenizer (at most {self.max_prompt_chars} characters); shorten it.")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise InvalidPromptError(
                f"The {what} is not valid Unicode text: {error.reason} at position {error.start} "
                "(undecodable bytes?).") from None
        return text

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, prompt token ids) for any accepted prompt form."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self._encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            if text is not None:
                self.check_prompt_text(text)
            token_ids = self._token_id_list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text = prompt["prompt"]
            token_ids = self._encode(text)
        else:
            raise InvalidPromptError(
                f"Unsupported prompt {type(prompt).__name__}: pass a str, {{'prompt': str}} or "
                "{'prompt_token_ids': list[int]}."
            )
        self._check_token_ids(token_ids)
        return text, token_ids

    def _encode(self, text: object) -> list[int]:
        text = self.check_prompt_text(text)
        return self.tokenizer.encode(text, add_special_tokens=True)

    def _token_id_list(self, token_ids: object) -> list[int]:
        if not isinstance(token_ids, (list, tuple)):
            raise InvalidPromptError(
                f"prompt_token_ids must be a list of ints, got {type(token_ids).__name__}.")
        return list(token_ids)

    def _check_token_ids(self, token_ids: list[int], num_images: int = 0) -> None:
        if not token_ids:
            raise InvalidPromptError("The prompt is empty: it must contain at least one token.")
        if num_images and len(token_ids) >= self.max_model_len:
            raise TooManyMultiModalItemsError(
                f"With its {num_images} image(s) expanded the prompt has {len(token_ids)} tokens, but "
                f"max_model_len is {self.max_model_len}: send fewer or smaller images, or raise max_model_len.")
        if len(token_ids) >= self.max_model_len:
            raise InvalidPromptError(
                f"The prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}: "
                f"a prompt may have at most {self.max_model_len - 1} tokens so that one can be generated."
            )
        # The range here (min/max run in C); that each id is an int, not a bool or a float, is
        # checked by the engine core's own decode in check_decodable().
        try:
            in_range = 0 <= min(token_ids) and max(token_ids) < self.vocab_size
        except TypeError:  # ids that do not even compare with ints
            in_range = False
        if not in_range:
            raise InvalidPromptError(
                f"prompt_token_ids must be integers in [0, {self.vocab_size}) for this model."
            )

    def process_multimodal(self, prompt: dict[str, Any]) -> tuple[str | None, list[int], list[MultiModalFeatureSpec]]:
        """Images + prompt -> expanded token ids and one MultiModalFeatureSpec per image."""
        if self.mm_processor is None:
            raise MultiModalNotSupportedError(
                "this model is text-only: it cannot take multi_modal_data; use a vision-language model "
                "(e.g. --model demo-vlm).")
        if "prompt_token_ids" in prompt:
            prompt = {**prompt, "prompt_token_ids": self._token_id_list(prompt["prompt_token_ids"])}
            if prompt.get("prompt") is not None:
                self.check_prompt_text(prompt["prompt"])
        else:
            self.check_prompt_text(prompt.get("prompt"))
        processed = self.mm_processor.process(prompt, self.tokenizer)
        self._check_token_ids(processed.token_ids, len(processed.features))
        return prompt.get("prompt"), processed.token_ids, processed.features

    def finalize_for_send(self, requests: list[EngineCoreRequest]) -> None:
        """Right before sending: let the ProcessorCache drop data the engine core holds."""
        if self.mm_processor is None:
            return
        for request in requests:
            if request.mm_features:
                request.mm_features = self.mm_processor.finalize(request.mm_features)

    # -- requests ---------------------------------------------------------------------------
    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       arrival_time: float | None = None, cache_salt: str | None = None, priority: int = 0,
                       lora_request: LoRARequest | None = None) -> tuple[str | None, EngineCoreRequest]:
        """Validate, tokenize and normalise one request (n is treated as 1)."""
        check_request_id(request_id)
        return self._process_verified(request_id, prompt, self._verified_copy(params), arrival_time, cache_salt,
                                      priority, lora_request)

    def check_lora_request(self, lora_request: object) -> LoRARequest | None:
        """The request's adapter if this engine can run it; InvalidLoRARequestError otherwise."""
        if lora_request is None:
            return None
        if self.lora is None:
            name = getattr(lora_request, "lora_name", None)
            raise InvalidLoRARequestError(
                f"Request names LoRA adapter {name!r:.80}, but LoRA is not enabled: start the engine with "
                "enable_lora=True (lmc: --enable-lora).")
        return self.lora.check(lora_request)

    def check_priority(self, priority: object) -> int:
        """The priority if this engine can honour it; InvalidPriorityError otherwise."""
        if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**63) <= priority < 2**63:
            raise InvalidPriorityError(f"priority must be an int (a lower value is scheduled first), got "
                                       f"{type(priority).__name__} {priority!r:.40}.")
        if priority != 0 and self.scheduling_policy != "priority":
            raise InvalidPriorityError(
                f"Got priority={priority}, but priority scheduling is not enabled: start the engine with "
                f"scheduling_policy='priority' (now {self.scheduling_policy!r}), or leave priority at 0.")
        return priority

    def _process_verified(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          arrival_time: float | None = None, cache_salt: str | None = None, priority: int = 0,
                          lora_request: LoRARequest | None = None) -> tuple[str | None, EngineCoreRequest]:
        """process_inputs() with params already a verified private copy (it is modified)."""
        priority = self.check_priority(priority)
        lora_request = self.check_lora_request(lora_request)
        if isinstance(prompt, dict):
            unknown = sorted(str(key) for key in prompt if key not in PROMPT_KEYS)
            if unknown:
                raise InvalidPromptError(f"Unknown prompt key(s) {unknown}; allowed: {sorted(PROMPT_KEYS)}.")
            if cache_salt is None:
                cache_salt = prompt.get("cache_salt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            got = "an empty str" if cache_salt == "" else type(cache_salt).__name__
            raise InvalidPromptError(
                f"cache_salt must be a non-empty str or None, got {got}: only requests with the same "
                "salt share prefix-cache blocks.")
        mm_features = None
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            text, token_ids, mm_features = self.process_multimodal(prompt)
        else:
            text, token_ids = self.tokenize_prompt(prompt)
        remaining = self.max_model_len - len(token_ids)
        if params.max_tokens is None or params.max_tokens > remaining:
            params.max_tokens = remaining
        params.min_tokens = min(params.min_tokens, params.max_tokens)
        params.all_stop_token_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            # EOS joins the set so min_tokens masks it too; the scheduler checks EOS first.
            params.all_stop_token_ids |= self.extra_stop_token_ids
            if self.eos_token_id is not None:
                params.all_stop_token_ids.add(self.eos_token_id)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            cache_salt=cache_salt,
            mm_features=mm_features or None,
            priority=priority,
            lora_request=lora_request,
        )
        check_decodable(request)
        return text, request

    def _verified_copy(self, params: object) -> SamplingParams:
        """A private copy of the params, validated again (the caller may have changed a field)."""
        if not isinstance(params, SamplingParams):
            raise InvalidSamplingParamsError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}."
            )
        params = params.clone()
        params.verify()
        if params.logprobs is not None and 0 <= self.max_logprobs < params.logprobs:
            raise InvalidSamplingParamsError(
                f"SamplingParams.logprobs={params.logprobs} is invalid: at most max_logprobs="
                f"{self.max_logprobs} (an engine argument) logprobs per token may be requested.")
        if params.prompt_logprobs is not None and 0 <= self.max_logprobs < params.prompt_logprobs:
            raise InvalidSamplingParamsError(
                f"SamplingParams.prompt_logprobs={params.prompt_logprobs} is invalid: at most max_logprobs="
                f"{self.max_logprobs} (an engine argument) logprobs per prompt token may be requested.")
        if params.logit_bias is not None:
            invalid = sorted(t for t in params.logit_bias if t >= self.vocab_size)
            if invalid:
                raise InvalidSamplingParamsError(
                    f"SamplingParams.logit_bias={_first(invalid)} is invalid: token id(s) {_first(invalid)} in "
                    f"logit_bias are out of vocabulary (vocab_size {self.vocab_size}).")
        if params.allowed_token_ids is not None:
            invalid = sorted({t for t in params.allowed_token_ids if t >= self.vocab_size})
            if invalid:
                raise InvalidSamplingParamsError(
                    f"SamplingParams.allowed_token_ids={_first(invalid)} is invalid: token id(s) {_first(invalid)} "
                    f"in allowed_token_ids are out of vocabulary (vocab_size {self.vocab_size}).")
        if any(t >= self.vocab_size for t in params.stop_token_ids or ()):
            raise InvalidSamplingParamsError(
                f"SamplingParams.stop_token_ids={params.stop_token_ids} is invalid: token ids must be "
                f"< vocab_size ({self.vocab_size}).")
        return params

    def process_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                        cache_salt: str | None = None, priority: int = 0,
                        lora_request: LoRARequest | None = None) -> list[ChildRequest]:
        """One request for n == 1; else n child requests under one ParentRequest.

        The prompt is processed once. Children get ids "{index}_{request_id}-{nonce}" (the
        nonce: a live id cannot be guessed into a collision) and seeds seed + index, so they differ.
        cache_salt joins the first block's hash: only requests with the same salt share it.
        """
        check_request_id(request_id)
        params = self._verified_copy(params)
        if params.n == 1:
            text, request = self._process_verified(request_id, prompt, params, cache_salt=cache_salt,
                                                   priority=priority, lora_request=lora_request)
            return [(text, request, None, 0)]
        from lm_console.engine.frontend.output_processor import ParentRequest

        num_children = params.n
        params.n = 1
        text, first = self._process_verified(request_id, prompt, params, cache_salt=cache_salt, priority=priority,
                                             lora_request=lora_request)
        parent = ParentRequest(request_id=request_id, n=num_children)
        nonce = secrets.token_hex(4)
        children: list[ChildRequest] = []
        for index in range(num_children):
            child_params = first.sampling_params.clone()
            if params.seed is not None:
                child_params.seed = _wrap_int64(params.seed + index)
            child = msgspec.structs.replace(first, request_id=f"{index}_{request_id}-{nonce}",
                                            sampling_params=child_params)
            children.append((text, child, parent, index))
        return children


def _first(ids: list[int], limit: int = 10) -> str:
    """The first ids of a list for an error message (a client may send thousands)."""
    shown = ", ".join(str(t) for t in ids[:limit])
    return f"[{shown}{', ...' if len(ids) > limit else ''}]"


def _wrap_int64(value: int) -> int:
    """value in the signed 64-bit range, wrapping around (child seeds seed + index)."""
    return (value + 2**63) % 2**64 - 2**63


def lora_admission(config: EngineConfig) -> LoRAAdmission | None:
    """The frontend's LoRA check for an EngineConfig, None when LoRA is off."""
    if config.lora_config is None:
        return None
    return LoRAAdmission(config.lora_config, config.model_config)


def make_mm_processor(config: EngineConfig) -> MultiModalProcessor | None:
    """The frontend's MultiModalProcessor for an EngineConfig, None for a text-only model."""
    model = config.model_config
    if not model.is_multimodal:
        return None
    mm = config.mm_config
    return MultiModalProcessor(
        Path(model.model_dir), model.model_name, model.architectures,
        hasher_algorithm=mm.mm_hasher_algorithm if mm is not None else "auto",
        cache_bytes=mm.processor_cache_bytes if mm is not None else 0)
