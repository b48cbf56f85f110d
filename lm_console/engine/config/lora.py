"""LoRAConfig: multi-LoRA serving (vLLM's LoRAConfig: enable_lora, max_loras, max_lora_rank,
max_cpu_loras)."""

from __future__ import annotations

from dataclasses import dataclass

from lm_console.engine.errors import InvalidEngineArgsError

MAX_LORA_RANK_LIMIT = 512


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidEngineArgsError(f"{name} must be an int {bound}, got {value!r:.40}.")
    return value


@dataclass(frozen=True)
class LoRAConfig:
    """How many adapters run at once and how large they may be.

    max_loras adapters are resident (stacked in the model's LoRA slots) and may run in one step;
    the scheduler admits a request whose adapter is not among the running ones only while fewer
    than max_loras distinct adapters run. max_cpu_loras adapters (>= max_loras; None: max_loras)
    stay loaded in host memory, least recently used evicted first; an adapter is loaded from
    its files the first time a request asks for it. Adapters of rank above max_lora_rank are
    refused at admission. The slots hold max_loras x max_lora_rank of every target module, so
    both size the memory LoRA takes.
    """

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise InvalidEngineArgsError(f"enable_lora must be a bool, got {self.enable_lora!r:.40}.")
        _check_int("max_loras", self.max_loras, 1, 256)
        _check_int("max_lora_rank", self.max_lora_rank, 1, MAX_LORA_RANK_LIMIT)
        if self.max_cpu_loras is not None:
            _check_int("max_cpu_loras", self.max_cpu_loras, 1)
            if self.max_cpu_loras < self.max_loras:
                raise InvalidEngineArgsError(
                    f"max_cpu_loras={self.max_cpu_loras} is below max_loras={self.max_loras}: every resident "
                    "adapter is also kept in host memory; raise max_cpu_loras or leave it unset (= max_loras).")

    @property
    def cpu_capacity(self) -> int:
        """Adapters kept in host memory (max_cpu_loras, or max_loras when unset)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
