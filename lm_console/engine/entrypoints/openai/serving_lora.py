"""The server's LoRA adapters: `--lora-modules name=path`, chosen by a request's `model`, listed in
/v1/models with their parent, loaded and unloaded at run time (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter, answered only when VLLM_ALLOW_RUNTIME_LORA_UPDATING is on)."""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING

from pydantic import Field

from lm_console.engine.entrypoints.openai.errors import OpenAIError, bad_request
from lm_console.engine.entrypoints.openai.protocol import RequestModel
from lm_console.engine.errors import InvalidLoRARequestError
from lm_console.engine.lora.builtin import BUILTIN_ADAPTERS, builtin_adapter
from lm_console.engine.lora.request import LoRARequest

if TYPE_CHECKING:
    from lm_console.engine.frontend.async_llm import AsyncLLM


class LoadLoRAAdapterRequest(RequestModel):
    """POST /v1/load_lora_adapter (vLLM's LoadLoRAAdapterRequest)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(RequestModel):
    """POST /v1/unload_lora_adapter (vLLM's UnloadLoRAAdapterRequest)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


def parse_lora_modules(specs: list[str]) -> list[tuple[str, str]]:
    """`name=path` strings (vLLM's --lora-modules form) or a built-in adapter's bare name ->
    (name, path); ValueError naming a bad one."""
    modules = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep and (builtin := builtin_adapter(spec)) is not None:
            modules.append(builtin)
            continue
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules {spec!r} must look like NAME=PATH (an adapter directory) "
                             f"or name a built-in adapter ({', '.join(BUILTIN_ADAPTERS)}).")
        modules.append((name.strip(), path.strip()))
    names = [name for name, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names an adapter twice: {names}.")
    return modules


class LoRAModules:
    """Adapter name -> LoRARequest. Ids are never reused: an adapter loaded again after an unload
    gets a new id, so no prefix-cache block or resident slot of the old one is ever taken for it."""

    def __init__(self, engine: AsyncLLM, base_names: list[str]) -> None:
        self.engine = engine
        self.base_names = list(base_names)
        self.enabled = engine.config.lora_config is not None
        self._adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return list(self._adapters)

    def items(self) -> list[tuple[str, LoRARequest]]:
        return list(self._adapters.items())

    def get(self, name: str | None) -> LoRARequest | None:
        return self._adapters.get(name) if name is not None else None

    def add(self, name: str, path: str) -> LoRARequest:
        """Check the adapter against the engine (files, rank, base model) and register it under
        `name`; OpenAIError 400 saying why not."""
        if not self.enabled:
            raise bad_request("LoRA is not enabled: start the server with --enable-lora.", "lora_name")
        with self._lock:
            if name in self._adapters:
                raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
            if name in self.base_names:
                raise bad_request(f"'{name}' is the base model's name; choose another adapter name.", "lora_name")
            lora_id = next(self._ids)
        try:
            request = LoRARequest(name, lora_id, path)
            self.engine.input_processor.check_lora_request(request)
        except InvalidLoRARequestError as error:
            raise bad_request(str(error), "lora_path") from None
        with self._lock:
            if name in self._adapters:  # another load of the same name won the race
                raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
            self._adapters[name] = request
        return request

    def remove(self, name: str, lora_int_id: int | None = None) -> LoRARequest:
        """Forget the adapter; requests already running with it finish with it. 404 if unknown."""
        with self._lock:
            request = self._adapters.get(name)
            if request is None or (lora_int_id is not None and lora_int_id != request.lora_int_id):
                raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                                  code="model_not_found")
            del self._adapters[name]
        lora = self.engine.input_processor.lora
        if lora is not None:
            lora.forget(request.lora_int_id)
        return request
