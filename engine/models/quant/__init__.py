"""Quantized weights for CPU inference: put packed int8/int4 weights into a loaded model.

Two methods (ModelConfig.quantization):

- "gguf": the model came from a GGUF file; its quantized tensors (Q8_0, Q4_0, Q4_1 as they are,
  Q4_K / Q6_K / others requantized per block of 32, see gguf_repack.py) replace the linears'
  dense weights, the tied embedding / lm_head included.
- "int8": any model; every linear (and the embedding / lm_head) is quantized to int8 per output
  channel (as vLLM's CPU W8A8), with dynamic int8 activations per block of 32 (per token
  measured +2.9% perplexity on SmolLM2).

The model is first built and loaded dense (the HF-format directory), then `quantize_model`
attaches a `QuantWeight` to each Linear / Embedding and drops the dense copy (replaced by a
`meta` tensor of the same shape, so anything still reading it fails loudly instead of reading
stale memory). Kernels: kernels/cpu_quant.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.errors import InvalidEngineArgsError
from engine.models.layers import Embedding, Linear
from kernels import cpu_quant
from kernels.cpu_quant import QuantWeight

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("int8", "gguf")

# Our fused linears and the checkpoint projections stacked in them, in row order.
_FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@dataclass(frozen=True, slots=True)
class QuantSummary:
    """What quantize_model did: layers quantized, their formats and resident bytes."""

    method: str
    num_linears: int
    num_dense_linears: int  # left dense (the file kept them unquantized)
    formats: tuple[str, ...]
    quantized_bytes: int


def _drop_dense(module: nn.Module) -> None:
    weight = module.weight
    module.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                 requires_grad=False)


def _source_names(linear_name: str) -> list[str]:
    prefix, _, last = linear_name.rpartition(".")
    parts = _FUSED_PARTS.get(last, (last,))
    return [f"{prefix}.{part}.weight" if prefix else f"{part}.weight" for part in parts]


def _gguf_weights(model: nn.Module, gguf_path: Path) -> dict[str, QuantWeight]:
    """Linear / embedding module name -> QuantWeight from the GGUF's quantized tensors."""
    from engine.models.quant.gguf_repack import pack_rows, read_gguf_quantized

    tensors = read_gguf_quantized(gguf_path, model.config)
    weights: dict[str, QuantWeight] = {}
    for name, module in model.named_modules():
        if isinstance(module, Embedding):
            if f"{name}.weight" in tensors:
                weights[name] = pack_rows([tensors[f"{name}.weight"]])
        elif isinstance(module, Linear):
            sources = _source_names(name)
            if name.endswith("lm_head") and sources[0] not in tensors:
                sources = ["model.embed_tokens.weight"]  # tied: the head is the embedding
            if all(s in tensors for s in sources):
                weights[name] = pack_rows([tensors[s] for s in sources])
    return weights


def quantize_model(model: nn.Module, method: str, gguf_path: Path | None = None) -> QuantSummary:
    """Replace the dense weights of the model's linears (and embedding) by packed quantized ones."""
    if method not in QUANTIZATION_METHODS:
        raise InvalidEngineArgsError(f"quantization={method!r} is not supported; supported: "
                                     f"{', '.join(QUANTIZATION_METHODS)}")
    if cpu_quant.load() is None:
        raise InvalidEngineArgsError(
            f"quantization={method!r} needs the CPU quantized kernels, which could not be built "
            "(no C compiler, LMC_CPU_KERNELS=0, or a build error: see the log)")
    if method == "gguf":
        if gguf_path is None:
            raise InvalidEngineArgsError("quantization='gguf' needs a model loaded from a GGUF file")
        weights = _gguf_weights(model, Path(gguf_path))
    else:
        weights = {}
        shared: dict[int, QuantWeight] = {}  # a tied head and embedding share one packed copy
        for name, module in model.named_modules():
            if isinstance(module, (Linear, Embedding)) and module.weight.device.type != "meta":
                key = id(module.weight)
                if key not in shared:
                    shared[key] = cpu_quant.quantize_int8_per_channel(module.weight)
                weights[name] = shared[key]
    linears = dense = 0
    for name, module in model.named_modules():
        if not isinstance(module, (Linear, Embedding)):
            continue
        quant = weights.get(name)
        if isinstance(module, Linear):
            linears += 1
            dense += quant is None
        if quant is None:
            continue
        if tuple(module.weight.shape) != (quant.out_features, quant.in_features):
            raise ValueError(f"{name}: quantized weight {quant.out_features}x{quant.in_features} "
                             f"does not match {tuple(module.weight.shape)}")
        module.set_quant_weight(quant)
    for name, module in model.named_modules():  # after all: tied modules share one weight
        if isinstance(module, (Linear, Embedding)) and module.quant is not None:
            _drop_dense(module)
    unique = {id(q): q for q in weights.values()}.values()
    summary = QuantSummary(method, linears, dense, tuple(sorted({q.source for q in unique})),
                           sum(q.nbytes() for q in unique))
    logger.info("quantization=%s: %d of %d linears quantized (%s), %.1f MB packed", method,
                linears - dense, linears, ", ".join(summary.formats), summary.quantized_bytes / 1e6)
    return summary
