"""InputProcessor: validate and tokenize a prompt into an EngineCoreRequest (seed: 1986-2057)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Union

from engine.errors import (
    InvalidPromptError, InvalidSamplingParamsError, MultiModalNotSupportedError, TooManyMultiModalItemsError,
)
from engine.protocol import EngineCoreRequest
from engine.sampling_params import SamplingParams

PromptType = Union[str, dict[str, Any]]

if TYPE_CHECKING:
    from engine.frontend.output_processor import ParentRequest
    from engine.multimodal.inputs import MultiModalFeatureSpec
    from engine.multimodal.processing import MultiModalProcessor

# (prompt text, request, parent when n > 1, child index)
ChildRequest = tuple[Union[str, None], EngineCoreRequest, "ParentRequest | None", int]


class InputProcessor:
    """Turns user prompts into EngineCoreRequests; every check runs before the engine sees it."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int,
                 eos_token_id: int | None, extra_stop_token_ids: set[int] | None = None,
                 mm_processor: MultiModalProcessor | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.extra_stop_token_ids = extra_stop_token_ids or set()
        self.mm_processor = mm_processor  # None: a text-only model

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, prompt token ids) for any accepted prompt form."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            text = prompt["prompt"]
            token_ids = self.tokenizer.encode(text, add_special_tokens=True)
        else:
            raise InvalidPromptError(
                f"Unsupported prompt {type(prompt).__name__}: pass a str, {{'prompt': str}} or "
                "{'prompt_token_ids': list[int]}."
            )
        self._check_token_ids(token_ids)
        return text, token_ids

    def _check_token_ids(self, token_ids: list[int], num_images: int = 0) -> None:
        if not token_ids:
            raise InvalidPromptError("The prompt is empty: it must contain at least one token.")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in token_ids):
            raise InvalidPromptError(
                f"prompt_token_ids must be integers in [0, {self.vocab_size}) for this model."
            )
        if num_images and len(token_ids) >= self.max_model_len:
            raise TooManyMultiModalItemsError(
                f"With its {num_images} image(s) expanded the prompt has {len(token_ids)} tokens, but "
                f"max_model_len is {self.max_model_len}: send fewer or smaller images, or raise max_model_len.")
        if len(token_ids) >= self.max_model_len:
            raise InvalidPromptError(
                f"The prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}: "
                f"a prompt may have at most {self.max_model_len - 1} tokens so that one can be generated."
            )

    def process_multimodal(self, prompt: dict[str, Any]) -> tuple[str | None, list[int], list[MultiModalFeatureSpec]]:
        """Images + prompt -> expanded token ids and one MultiModalFeatureSpec per image."""
        if self.mm_processor is None:
            raise MultiModalNotSupportedError(
                "this model is text-only: it cannot take multi_modal_data; use a vision-language model "
                "(e.g. --model demo-vlm).")
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

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       arrival_time: float | None = None, cache_salt: str | None = None
                       ) -> tuple[str | None, EngineCoreRequest]:
        """Validate, tokenize and normalise one request."""
        if not isinstance(params, SamplingParams):
            raise InvalidSamplingParamsError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}."
            )
        mm_features = None
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            text, token_ids, mm_features = self.process_multimodal(prompt)
        else:
            text, token_ids = self.tokenize_prompt(prompt)
        params = params.clone()
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
        )
        return text, request

    def process_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                        cache_salt: str | None = None) -> list[ChildRequest]:
        """One request for n == 1; else n child requests under one ParentRequest.

        Children get ids "{index}_{request_id}" and seeds seed + index, so they differ.
        cache_salt joins the first block's hash: only requests with the same salt share it.
        """
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidPromptError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}.")
        if not isinstance(params, SamplingParams) or params.n == 1:
            text, request = self.process_inputs(request_id, prompt, params, cache_salt=cache_salt)
            return [(text, request, None, 0)]
        from engine.frontend.output_processor import ParentRequest

        parent = ParentRequest(request_id=request_id, n=params.n)
        children: list[ChildRequest] = []
        for index in range(params.n):
            child_params = params.clone()
            child_params.n = 1
            if params.seed is not None:
                child_params.seed = params.seed + index
            text, request = self.process_inputs(f"{index}_{request_id}", prompt, child_params,
                                                cache_salt=cache_salt)
            children.append((text, request, parent, index))
        return children
