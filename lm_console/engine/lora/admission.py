"""The frontend's LoRA check at admission: LoRA enabled, the adapter's files sound and made for
this base model, its id naming one adapter (torch-free)."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from lm_console.engine.config.lora import LoRAConfig
from lm_console.engine.config.model import ModelConfig
from lm_console.engine.errors import InvalidLoRARequestError
from lm_console.engine.lora.adapter_files import AdapterSpec, BaseShapes, read_adapter
from lm_console.engine.lora.request import LoRARequest

_MAX_REMEMBERED = 1024


def base_shapes(model: ModelConfig) -> BaseShapes:
    """The dimensions of `model` an adapter must match."""
    return BaseShapes(hidden=model.hidden_size, q=model.num_attention_heads * model.head_dim,
                      kv=model.num_kv_heads * model.head_dim, inter=model.intermediate_size,
                      num_layers=model.num_layers)


class LoRAAdmission:
    """Checks each request's LoRARequest before it is sent to the engine core.

    An adapter's files are read (config and safetensors header only) once per (path, size,
    mtime); an id keeps the name and path it was first seen with, so that the worker's caches,
    keyed by id, can never serve one adapter's weights for another.
    """

    def __init__(self, lora_config: LoRAConfig | None, model: ModelConfig) -> None:
        self.lora_config = lora_config
        self.base = base_shapes(model)
        self._specs: OrderedDict[tuple[str, int, int], AdapterSpec] = OrderedDict()
        self._ids: OrderedDict[int, tuple[str, str]] = OrderedDict()
        self._lock = threading.Lock()  # AsyncLLM checks on an input thread too

    def check(self, lora_request: object) -> LoRARequest | None:
        """The request's adapter once accepted (None: the base model); InvalidLoRARequestError."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise InvalidLoRARequestError(
                f"lora_request must be a LoRARequest(lora_name, lora_int_id, lora_path) or None, got "
                f"{type(lora_request).__name__}.")
        config = self.lora_config
        if config is None:
            raise InvalidLoRARequestError(
                f"Request names LoRA adapter {lora_request.lora_name!r}, but LoRA is not enabled: start the engine "
                "with enable_lora=True (lmc: --enable-lora).")
        self.spec_of(lora_request)
        with self._lock:
            known = self._ids.get(lora_request.lora_int_id)
            current = (lora_request.lora_name, os.path.realpath(lora_request.lora_path))
            if known is not None and known != current:
                raise InvalidLoRARequestError(
                    f"lora_int_id={lora_request.lora_int_id} already names adapter {known[0]!r} at {known[1]!r}; "
                    "each adapter needs its own id.")
            self._ids[lora_request.lora_int_id] = current
            self._ids.move_to_end(lora_request.lora_int_id)
            while len(self._ids) > _MAX_REMEMBERED:
                self._ids.popitem(last=False)
        return lora_request

    def forget(self, lora_int_id: int) -> None:
        """Let the id name another adapter from now on (the server unloaded it)."""
        with self._lock:
            self._ids.pop(lora_int_id, None)

    def spec_of(self, lora_request: LoRARequest) -> AdapterSpec:
        """The checked spec of the request's adapter files (read once per file version)."""
        assert self.lora_config is not None
        path = lora_request.lora_path
        weights = os.path.join(path, "adapter_model.safetensors")
        try:
            stat = os.stat(weights)
            key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
        except OSError:
            key = None
        if key is not None:
            with self._lock:
                spec = self._specs.get(key)
            if spec is not None:
                self._check_rank(spec)
                return spec
        spec = read_adapter(path, self.base, self.lora_config.max_lora_rank)
        if key is not None:
            with self._lock:
                self._specs[key] = spec
                while len(self._specs) > _MAX_REMEMBERED:
                    self._specs.popitem(last=False)
        return spec

    def _check_rank(self, spec: AdapterSpec) -> None:
        assert self.lora_config is not None
        if spec.rank > self.lora_config.max_lora_rank:  # pragma: no cover - read_adapter checked it
            raise InvalidLoRARequestError(f"LoRA adapter {spec.path!r}: rank {spec.rank} exceeds max_lora_rank")
