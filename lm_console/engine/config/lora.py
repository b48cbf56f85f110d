"""LoRAConfig: multi-LoRA serving (vLLM's LoRAConfig: enable_lora, max_loras, max_lora_rank,
max_cpu_loras)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lm_console.engine.config.fields import DeclaredConfig, knob
from lm_console.engine.errors import InvalidEngineArgsError

MAX_LORA_RANK_LIMIT = 512
MAX_LORAS_LIMIT = 256
# The LoRA knobs' defaults: any other value without enable_lora would do nothing, so it is refused.
_LORA_DEFAULTS: dict[str, Any] = {"max_loras": 1, "max_lora_rank": 16, "max_cpu_loras": None}


@dataclass(frozen=True)
class LoRAConfig(DeclaredConfig):
    """How many adapters run at once and how large they may be.

    max_loras adapters are resident (stacked in the model's LoRA slots) and may run in one step;
    the scheduler admits a request whose adapter is not among the running ones only while fewer
    than max_loras distinct adapters run. max_cpu_loras adapters (>= max_loras; None: max_loras)
    stay loaded in host memory, least recently used evicted first; an adapter is loaded from
    its files the first time a request asks for it. Adapters of rank above max_lora_rank are
    refused at admission. The slots hold max_loras x max_lora_rank of every target module, so
    both size the memory LoRA takes.
    """

    enable_lora: bool = knob(False, help="Serve LoRA adapters (per request: LoRARequest, or the server's "
                                         "--lora-modules / a request's model).")
    max_loras: int = knob(1, ge=1, le=MAX_LORAS_LIMIT,
                          help="Adapters resident at once (the most distinct adapters in one step).")
    max_lora_rank: int = knob(16, ge=1, le=MAX_LORA_RANK_LIMIT,
                              help="Largest adapter rank accepted (sizes the adapter slots).")
    max_cpu_loras: int | None = knob(None, ge=1, help="Adapters kept in host memory, least recently used "
                                                      "evicted (>= max_loras; None: max_loras).")

    @classmethod
    def verify_relations(cls, values: Mapping[str, Any]) -> None:
        """The LoRA knobs need enable_lora; max_cpu_loras holds every resident adapter."""
        if not values.get("enable_lora", False):
            changed = [name for name, default in _LORA_DEFAULTS.items() if values.get(name, default) != default]
            if changed:
                raise InvalidEngineArgsError(
                    f"{', '.join(changed)} apply only with enable_lora=True (--enable-lora); "
                    "set enable_lora=True or leave them at their defaults.")
            return
        max_loras, max_cpu_loras = values.get("max_loras", 1), values.get("max_cpu_loras")
        if max_cpu_loras is not None and max_cpu_loras < max_loras:
            raise InvalidEngineArgsError(
                f"max_cpu_loras={max_cpu_loras} is below max_loras={max_loras}: every resident "
                "adapter is also kept in host memory; raise max_cpu_loras or leave it unset (= max_loras).")

    @property
    def cpu_capacity(self) -> int:
        """Adapters kept in host memory (max_cpu_loras, or max_loras when unset)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
