"""LoRARequest: which adapter a request runs with (vLLM's vllm.lora.request.LoRARequest)."""

from __future__ import annotations

import msgspec

from lm_console.engine.errors import InvalidLoRARequestError

MAX_LORA_NAME_CHARS = 256


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """A LoRA adapter for one request: a name, a positive integer id and the adapter's directory.

    The id identifies the adapter inside the engine (its resident slot, its host-memory cache
    entry); two requests with the same id must name the same adapter files. The name enters the
    prefix-cache key (with the id), so no KV block is shared across adapters, and it is what
    KV events and metrics report. lora_path is a PEFT adapter directory (adapter_config.json and
    adapter_model.safetensors).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name or len(self.lora_name) > MAX_LORA_NAME_CHARS:
            raise InvalidLoRARequestError(
                f"LoRARequest.lora_name must be a non-empty str of at most {MAX_LORA_NAME_CHARS} characters, "
                f"got {self.lora_name!r:.60}.")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or not 1 <= self.lora_int_id < 2**63:
            raise InvalidLoRARequestError(
                f"LoRARequest.lora_int_id must be an int >= 1 (0 means no adapter), got {self.lora_int_id!r:.40}.")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidLoRARequestError(
                f"LoRARequest.lora_path must name the adapter's directory (adapter_config.json and "
                f"adapter_model.safetensors), got {self.lora_path!r:.80}.")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of lora_int_id."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """vLLM's alias of lora_name."""
        return self.lora_name

    @property
    def path(self) -> str:
        """vLLM's alias of lora_path."""
        return self.lora_path
