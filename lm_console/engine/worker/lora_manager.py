"""The worker's adapters: max_loras resident in the model's slots, max_cpu_loras in host memory.

Each step the model runner asks `prepare_step` for the batch's adapters. An adapter not in host
memory is loaded from its files (checked again before any allocation: adapter_files.read_adapter)
and kept in an LRU of max_cpu_loras; one not resident is copied into a slot no adapter of this
step uses, the least recently used first. The scheduler admits at most max_loras distinct
adapters among the running requests, so a step's adapters always fit the slots.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lm_console.engine.config.lora import LoRAConfig
from lm_console.engine.config.model import ModelConfig
from lm_console.engine.errors import InvalidLoRARequestError
from lm_console.engine.lora.admission import base_shapes
from lm_console.engine.lora.adapter_files import AdapterSpec, read_adapter
from lm_console.engine.lora.request import LoRARequest
from lm_console.engine.models.layers import bump_weights_version
from lm_console.engine.models.lora import (
    PROJECTION_TO_LINEAR, LoRAMapping, attach_lora_slots, lora_linears,
)
from lm_console.kernels import lora_ops


@dataclass(slots=True)
class LoadedAdapter:
    """An adapter in host memory: each (layer, our linear, projection index) -> (A, B)."""

    lora_int_id: int
    name: str
    path: str
    scaling: float
    weights: dict[tuple[int, str, int], tuple[Tensor, Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def load_adapter(request: LoRARequest, spec: AdapterSpec, dtype: torch.dtype) -> LoadedAdapter:
    """Read the adapter's tensors (its files already checked by read_adapter) in `dtype`."""
    from safetensors import safe_open

    weights: dict[tuple[int, str, int], tuple[Tensor, Tensor]] = {}
    try:
        with safe_open(spec.weights_file, framework="pt") as f:
            for (layer, projection), (a_name, b_name) in spec.modules.items():
                linear, index = PROJECTION_TO_LINEAR[projection]
                a = f.get_tensor(a_name).to(dtype).contiguous()
                b = f.get_tensor(b_name).to(dtype).contiguous()
                weights[(layer, linear, index)] = (a, b)
    except (OSError, ValueError, RuntimeError) as error:  # changed or damaged since it was checked
        raise InvalidLoRARequestError(f"LoRA adapter {spec.path!r}: its weights cannot be read ({error})") from None
    return LoadedAdapter(request.lora_int_id, request.lora_name, request.lora_path, spec.scaling, weights)


class LoRAManager:
    """Resident slots and the host-memory LRU of one model's adapters."""

    def __init__(self, model: nn.Module, config: LoRAConfig, model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config = config
        self.base = base_shapes(model_config)
        self.dtype = dtype
        self.device = device
        attach_lora_slots(model, config.max_loras, config.max_lora_rank)
        bump_weights_version()  # plans that read the linears (the C decode stack) take the slots in
        self.linears = {(layer, name): linear for layer, name, linear in lora_linears(model)}
        self.cpu_cache: OrderedDict[int, LoadedAdapter] = OrderedDict()  # LRU: oldest first
        self.slot_ids: list[int | None] = [None] * config.max_loras  # adapter id in each slot
        self.slot_lru: list[int] = list(range(config.max_loras))  # least recently used first
        self.scalings = torch.zeros(config.max_loras, dtype=torch.float32, device=device)
        self.num_loads = 0  # adapters read from files (tests and stats)
        self.num_activations = 0  # adapters copied into a slot

    # -- host memory ----------------------------------------------------------------------------
    def _get_loaded(self, request: LoRARequest) -> LoadedAdapter:
        loaded = self.cpu_cache.get(request.lora_int_id)
        if loaded is not None:
            self.cpu_cache.move_to_end(request.lora_int_id)
            return loaded
        spec = read_adapter(request.lora_path, self.base, self.config.max_lora_rank)
        loaded = load_adapter(request, spec, self.dtype)
        self.num_loads += 1
        self.cpu_cache[request.lora_int_id] = loaded
        while len(self.cpu_cache) > self.config.cpu_capacity:
            # A resident adapter evicted here keeps its slot (its weights were copied there);
            # it is read from its files again only if it also leaves its slot.
            self.cpu_cache.popitem(last=False)
        return loaded

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter (host memory and its slot); whether it was known."""
        known = self.cpu_cache.pop(lora_int_id, None) is not None
        for slot, held in enumerate(self.slot_ids):
            if held == lora_int_id:
                self._clear_slot(slot)
                known = True
        return known

    def list_adapters(self) -> list[int]:
        """The ids in host memory, oldest use first."""
        return list(self.cpu_cache)

    # -- slots ----------------------------------------------------------------------------------
    def _clear_slot(self, slot: int) -> None:
        for linear in self.linears.values():
            linear.lora.clear(slot)
        self.slot_ids[slot] = None
        self.scalings[slot] = 0.0

    def _activate(self, loaded: LoadedAdapter, slot: int) -> None:
        for linear in self.linears.values():
            linear.lora.clear(slot)
        for (layer, name, index), (a, b) in loaded.weights.items():
            self.linears[(layer, name)].lora.set_projection(slot, index, a.to(self.device), b.to(self.device))
        self.slot_ids[slot] = loaded.lora_int_id
        self.scalings[slot] = loaded.scaling
        self.num_activations += 1

    def _touch(self, slot: int) -> None:
        self.slot_lru.remove(slot)
        self.slot_lru.append(slot)

    def slots_for(self, requests: list[LoRARequest | None]) -> list[int]:
        """Each request's slot (-1: none), making the step's adapters resident."""
        wanted: dict[int, LoRARequest] = {}
        for request in requests:
            if request is not None:
                wanted.setdefault(request.lora_int_id, request)
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} adapters but max_loras={self.config.max_loras} slots exist "
                               "(the scheduler admits at most max_loras adapters)")
        slot_of: dict[int, int] = {}
        for lora_id in wanted:
            if lora_id in self.slot_ids:
                slot_of[lora_id] = self.slot_ids.index(lora_id)
        for lora_id, request in wanted.items():
            if lora_id in slot_of:
                continue
            loaded = self._get_loaded(request)
            busy = set(slot_of.values())
            slot = next(s for s in self.slot_lru if s not in busy)
            self._activate(loaded, slot)
            slot_of[lora_id] = slot
        for slot in slot_of.values():
            self._touch(slot)
        return [-1 if request is None else slot_of[request.lora_int_id] for request in requests]

    def prepare_step(self, requests: list[LoRARequest | None], num_scheduled: list[int]) -> LoRAMapping | None:
        """The step's mapping (each token's slot), or None when no request has an adapter."""
        if all(request is None for request in requests):
            return None
        req_slots = self.slots_for(requests)
        token_slots = torch.repeat_interleave(torch.tensor(req_slots, dtype=torch.int64),
                                              torch.tensor(num_scheduled, dtype=torch.int64))
        token_slots = token_slots.to(self.device)
        return LoRAMapping(token_slots=token_slots, scalings=self.scalings, groups=lora_ops.slot_groups(token_slots))
