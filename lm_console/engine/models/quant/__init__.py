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
stale memory). Kernels: lm_console/kernels/cpu_quant.py.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.engine.models.layers import Embedding, Linear
from lm_console.kernels import cpu_quant
from lm_console.kernels.cpu_quant import QuantWeight
from lm_console.kernels.huge_pages import HugePageArena

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("int8", "gguf")
# The packed GGUF weights are cached beside the converted model (repacking takes seconds);
# a new layout gets a new name, so an old cache is never misread.
# (in a subdirectory: the loader reads every *.safetensors of the model directory itself).
PACKED_CACHE = "lmc-packed/gguf-v2.safetensors"  # v2: the rows in tiles of 16

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
    from lm_console.engine.models.quant.gguf_repack import pack_rows, read_gguf_quantized

    tensors = read_gguf_quantized(gguf_path, model.config)
    weights: dict[str, QuantWeight] = {}
    packed: dict[tuple[str, ...], QuantWeight] = {}  # a tied head shares the embedding's copy
    for name, module in model.named_modules():
        if isinstance(module, Embedding):
            sources = [f"{name}.weight"]
        elif isinstance(module, Linear):
            sources = _source_names(name)
            if name.endswith("lm_head") and sources[0] not in tensors:
                sources = ["model.embed_tokens.weight"]  # tied: the head is the embedding
        else:
            continue
        if all(s in tensors for s in sources):
            key = tuple(sources)
            if key not in packed:
                packed[key] = pack_rows([tensors[s] for s in sources])
            weights[name] = packed[key]
    return weights


def _save_packed(path: Path, weights: dict[str, QuantWeight]) -> None:
    """Write the packed weights (tied modules once) as safetensors, atomically; best effort."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    index: dict[str, dict[str, object]] = {}
    first: dict[int, str] = {}
    for name, q in weights.items():
        if id(q) in first:
            index[name] = {"alias": first[id(q)]}
            continue
        first[id(q)] = name
        index[name] = {"fmt": q.fmt, "out": q.out_features, "in": q.in_features, "source": q.source}
        tensors[f"{name}.qweight"], tensors[f"{name}.scales"] = q.qweight, q.scales
        if q.offsets is not None:
            tensors[f"{name}.offsets"] = q.offsets
    try:
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        os.close(fd)
        save_file(tensors, tmp, metadata={"index": json.dumps(index)})
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("could not cache the packed GGUF weights in %s: %s", path, exc)


def _load_packed(path: Path, max_bytes: int | None = None) -> dict[str, QuantWeight] | None:
    """The cached packed weights, or None (and the file deleted) when it is unreadable or larger
    than max_bytes: safetensors checks that every tensor lies inside the file, so the file's size
    bounds what loading it allocates, and a corrupt or foreign file (a sparse one declaring
    terabytes) is refused before anything is mapped or read; the caller repacks."""
    from safetensors import SafetensorError, safe_open

    try:
        size = path.stat().st_size
        if max_bytes is not None and size > max_bytes:
            raise ValueError(f"it is {size} bytes, more than the {max_bytes} its GGUF file can pack into")
        with safe_open(str(path), framework="pt", device="cpu") as f:
            index = json.loads(f.metadata()["index"])
            weights: dict[str, QuantWeight] = {}
            for name, entry in index.items():
                if "alias" in entry:
                    continue
                offsets = f.get_tensor(f"{name}.offsets") if entry["fmt"] != "c8" else None
                weights[name] = QuantWeight(entry["fmt"], entry["out"], entry["in"],
                                            f.get_tensor(f"{name}.qweight"), f.get_tensor(f"{name}.scales"),
                                            offsets, entry["source"])
            for name, entry in index.items():
                if "alias" in entry:
                    weights[name] = weights[entry["alias"]]
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as exc:
        logger.warning("removing the packed GGUF weight cache %s (%s); repacking", path, exc)
        try:
            path.unlink()
        except OSError:
            pass
        return None
    return weights


def _move_to_huge_pages(weights: dict[str, QuantWeight]) -> None:
    """Re-home every packed tensor (tied modules' shared copy once) in one allocation on huge
    pages. A decode step streams all of them from DRAM, and on 4 KiB pages (the cache file's
    private mapping, or numpy's buffers) that costs TLB misses: measured 16.4-18.2 -> 14.2-14.9 ms
    for SmolLM2's 120 linears at 29 rows on one core (lm_console/kernels/huge_pages.py)."""
    unique = list({id(q): q for q in weights.values()}.values())
    arena = HugePageArena.for_tensors(t for q in unique for t in (q.qweight, q.scales, q.offsets)
                                      if t is not None)
    for q in unique:  # each original is dropped once copied: never both whole sets at once
        q.qweight, q.scales = arena.copy(q.qweight), arena.copy(q.scales)
        if q.offsets is not None:
            q.offsets = arena.copy(q.offsets)
        q.kernel_args = None  # pointers into the old tensors


def quantize_model(model: nn.Module, method: str, gguf_path: Path | None = None,
                   cache_dir: Path | None = None) -> QuantSummary:
    """Replace the dense weights of the model's linears (and embedding) by packed quantized ones.

    cache_dir (method "gguf"): where the packed weights are cached (the converted model's dir)."""
    if method not in QUANTIZATION_METHODS:
        raise InvalidEngineArgsError(f"quantization={method!r} is not supported; supported: "
                                     f"{', '.join(QUANTIZATION_METHODS)}")
    if cpu_quant.load() is None:
        raise InvalidEngineArgsError(
            f"quantization={method!r} needs the CPU quantized kernels, which could not be built "
            "(no C compiler, LMC_CPU_KERNELS=0, or a build error: see the log); "
            "quantization='none' runs the dense weights")
    if method == "gguf":
        if gguf_path is None:
            raise InvalidEngineArgsError("quantization='gguf' needs a model loaded from a GGUF file")
        cached = Path(cache_dir) / PACKED_CACHE if cache_dir is not None else None
        # packed blocks take at most ~3.5x their GGUF bytes (Q2_K's 2.6 bits requantized to 8 + scales)
        limit = 4 * Path(gguf_path).stat().st_size + (1 << 20)
        weights = _load_packed(cached, limit) if cached is not None and cached.is_file() else None
        if weights is None:
            weights = _gguf_weights(model, Path(gguf_path))
            if cached is not None:
                _save_packed(cached, weights)
    else:
        weights = {}
        shared: dict[int, QuantWeight] = {}  # a tied head and embedding share one packed copy
        for name, module in model.named_modules():
            if isinstance(module, (Linear, Embedding)) and module.weight.device.type != "meta":
                key = id(module.weight)
                if key not in shared:
                    shared[key] = cpu_quant.quantize_int8_per_channel(module.weight)
                weights[name] = shared[key]
    _move_to_huge_pages(weights)
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
    for module in model.modules():  # after all: tied modules share one weight
        if isinstance(module, (Linear, Embedding)) and module.quant is not None:
            _drop_dense(module)
    unique = {id(q): q for q in weights.values()}.values()
    summary = QuantSummary(method, linears, dense, tuple(sorted({q.source for q in unique})),
                           sum(q.nbytes() for q in unique))
    logger.info("quantization=%s: %d of %d linears quantized (%s), %.1f MB packed", method,
                linears - dense, linears, ", ".join(summary.formats), summary.quantized_bytes / 1e6)
    return summary


def quantized_checkpoint_names(model: nn.Module) -> frozenset[str]:
    """Checkpoint tensor names whose destination holds quantized weights (not worth reading)."""
    names: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, Embedding) and module.quant is not None:
            names.add(f"{name}.weight")
        elif isinstance(module, Linear) and module.quant is not None:
            names.update(_source_names(name))
    return frozenset(names)


def refresh_biases(model: nn.Module) -> None:
    """Re-take the float32 bias copies of quantized linears (after a load that came later)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.quant is not None:
            module.set_quant_weight(module.quant)
