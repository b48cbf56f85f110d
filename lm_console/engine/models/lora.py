"""LoRA inside the model: stacked adapter slots on the linears, and the step's token mapping.

`attach_lora_slots(model, max_loras, max_rank)` gives each decoder layer's qkv_proj, o_proj,
gate_up_proj and down_proj a `LoRASlots`: every resident adapter's A and B for that linear,
stacked by slot. Our linears fuse q|k|v and gate|up, where PEFT has one adapter module per
projection; a fused linear's slot holds its projections side by side: A rows [i*R, i*R + r)
are projection i's A, and B's columns [i*R, i*R + r) of projection i's output rows are its B
(zero elsewhere, so one shrink and one expand compute every projection's own delta exactly).

The model runner sets the step's `LoRAMapping` (each token's slot, -1 for the base model;
each slot's scaling) around the forward with `lora_step`; `Linear.forward` then adds
scaling * (x A^T) B^T to its output for the tokens with an adapter (lm_console/kernels/lora_ops.py).
The base weights are untouched: a quantized linear runs its int8 kernels and the delta is added
beside, in the activation dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.kernels import lora_ops

# Our linear -> the HF projections fused in it, in output order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
# HF projection -> (our linear, its index among the fused projections)
PROJECTION_TO_LINEAR: dict[str, tuple[str, int]] = {
    proj: (linear, i) for linear, projs in FUSED_MODULES.items() for i, proj in enumerate(projs)
}


class LoRASlots(nn.Module):
    """One linear's adapter slots: a [max_loras, S * R, in], b [max_loras, out, S * R] (S fused
    projections of rank up to R), zero where no adapter (or a smaller rank) fills them.

    On the CPU, b is a transposed view of `b_t` [max_loras, S * R, out], the layout the C LoRA
    kernel reads (its expand runs along the outputs); elsewhere b is contiguous and b_t None."""

    def __init__(self, in_features: int, out_sizes: list[int], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.out_sizes = list(out_sizes)
        self.out_offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.max_rank = max_rank
        num = len(out_sizes)
        self.register_buffer("a", torch.zeros(max_loras, num * max_rank, in_features, dtype=dtype, device=device),
                             persistent=False)
        self.b_t: Tensor | None
        if device.type == "cpu":
            self.register_buffer("b_t", torch.zeros(max_loras, num * max_rank, sum(out_sizes), dtype=dtype,
                                                    device=device), persistent=False)
            self.b = self.b_t.transpose(1, 2)
        else:
            self.register_buffer("b", torch.zeros(max_loras, sum(out_sizes), num * max_rank, dtype=dtype,
                                                  device=device), persistent=False)
            self.b_t = None

    def clear(self, slot: int) -> None:
        """No adapter in `slot` (its rows and columns all zero)."""
        self.a[slot].zero_()
        self.b[slot].zero_()

    def set_projection(self, slot: int, index: int, a: Tensor, b: Tensor) -> None:
        """Put projection `index`'s A [r, in] and B [out_i, r] into `slot`."""
        rank = a.shape[0]
        lo = index * self.max_rank
        off, size = self.out_offsets[index], self.out_sizes[index]
        self.a[slot, lo:lo + rank].copy_(a)
        self.b[slot, off:off + size, lo:lo + rank].copy_(b)


@dataclass(slots=True)
class LoRAMapping:
    """One step's adapter use: token_slots [num_tokens] int64 (-1: base model), scalings
    [max_loras] float32, and the torch path's grouping of tokens by slot."""

    token_slots: Tensor
    scalings: Tensor
    groups: list[tuple[int, Tensor]]

    @property
    def has_adapters(self) -> bool:
        return bool(self.groups)


_active: LoRAMapping | None = None


@contextmanager
def lora_step(mapping: LoRAMapping | None) -> Iterator[None]:
    """Apply `mapping` in every LoRA linear for the duration of the block (one forward)."""
    global _active
    previous, _active = _active, mapping
    try:
        yield
    finally:
        _active = previous


def step_has_adapters() -> bool:
    """Whether the forward in progress has a token with an adapter."""
    return _active is not None and _active.has_adapters


def active_mapping() -> LoRAMapping | None:
    """The forward in progress' mapping (None outside `lora_step`): for paths that run the
    linears themselves (the C decode stack) and must add the same deltas."""
    return _active


def add_delta(slots: LoRASlots, x: Tensor, y: Tensor) -> Tensor:
    """y (the base linear's output for x) plus the step's LoRA deltas, in place when any."""
    mapping = _active
    if mapping is None or not mapping.groups:
        return y
    if x.shape[0] != mapping.token_slots.shape[0]:
        raise RuntimeError(f"LoRA mapping covers {mapping.token_slots.shape[0]} tokens, the linear got {x.shape[0]}")
    x = x.contiguous()
    if x.dtype != slots.a.dtype:
        x = x.to(slots.a.dtype)
    if y.dtype != slots.a.dtype:  # a quantized kernel's float32 output: add in the adapter's dtype
        delta = torch.zeros(y.shape, dtype=slots.a.dtype, device=y.device)
        lora_ops.add_lora(delta, x, slots.a, slots.b, mapping.token_slots, mapping.scalings, mapping.groups)
        return y.add_(delta)
    return lora_ops.add_lora(y, x, slots.a, slots.b, mapping.token_slots, mapping.scalings, mapping.groups)


def lora_linears(model: nn.Module) -> Iterator[tuple[int, str, Any]]:
    """(layer index, our linear's name, the linear) of every linear LoRA applies to."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise InvalidEngineArgsError(
            f"LoRA is not supported for {type(model).__name__}: it applies to the Llama family, Qwen2/3 and Gemma3.")
    for index, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        for owner, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
            linear = getattr(owner, name, None)
            if linear is None:
                raise InvalidEngineArgsError(
                    f"LoRA is not supported for {type(model).__name__}: layer {index} has no {name}.")
            yield index, name, linear


def _out_sizes(model: nn.Module, name: str, linear: Any) -> list[int]:
    if name == "qkv_proj":
        attn = model.model.layers[0].self_attn  # type: ignore[index, union-attr]
        return [attn.q_size, attn.kv_size, attn.kv_size]
    if name == "gate_up_proj":
        half = int(linear.weight.shape[0]) // 2
        return [half, half]
    return [int(linear.weight.shape[0])]


def attach_lora_slots(model: nn.Module, max_loras: int, max_rank: int) -> None:
    """Give every LoRA-capable linear of `model` its slots (built on the weights' device)."""
    # By class name: the model modules import this one (through layers.py), not the other way.
    if type(model).__name__ not in SUPPORTED:
        raise InvalidEngineArgsError(
            f"LoRA is not supported for {type(model).__name__}: it applies to {', '.join(sorted(SUPPORTED))}.")
    dtype = model.dtype  # type: ignore[attr-defined]
    for _, name, linear in lora_linears(model):
        if getattr(linear, "tp_size", 1) != 1:
            raise InvalidEngineArgsError("LoRA runs on one tensor-parallel rank only (tensor_parallel_size=1).")
        weight = linear.weight
        in_features = int(weight.shape[1])
        device = linear.quant.qweight.device if linear.quant is not None else weight.device
        linear.lora = LoRASlots(in_features, _out_sizes(model, name, linear), max_loras, max_rank, dtype, device)


SUPPORTED = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration", "Gemma3VLForConditionalGeneration",
})
