"""Check a PEFT LoRA adapter's files before a byte of its weights is read (torch-free).

An adapter is a directory with adapter_config.json and adapter_model.safetensors. `read_adapter`
reads the JSON and only the safetensors header (bounded in size and JSON nesting), and checks
that every tensor is one this engine applies (lora_A / lora_B of q/k/v/o/gate/up/down in a
decoder layer), of a float dtype, with its declared bytes inside the file and the file exactly
as long as the tensors need, and with shapes that fit the base model and max_lora_rank. Only then
may the worker load it (lm_console/engine/models/lora.py). The frontend runs it at admission, so
a bad adapter is that request's InvalidLoRARequestError, not a failed engine step.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lm_console.engine.errors import InvalidLoRARequestError
from lm_console.engine.safetensors_header import SafetensorsHeaderError, read_header

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 20  # a 100-layer adapter's header is ~150 kB
_MAX_HEADER_DEPTH = 3  # {"name": {"shape": [...]}}
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}

# HF projection -> (sub-module, which base dimension is its input, which its output)
MODULES: dict[str, tuple[str, str, str]] = {
    "q_proj": ("self_attn", "hidden", "q"),
    "k_proj": ("self_attn", "hidden", "kv"),
    "v_proj": ("self_attn", "hidden", "kv"),
    "o_proj": ("self_attn", "q", "hidden"),
    "gate_proj": ("mlp", "hidden", "inter"),
    "up_proj": ("mlp", "hidden", "inter"),
    "down_proj": ("mlp", "inter", "hidden"),
}
# Where PEFT puts the decoder layers: a causal LM (Llama, Qwen2/3, Gemma3) and a Gemma3 VLM's
# language model (transformers 5 and the released layout).
_PREFIXES = ("base_model.model.model.", "base_model.model.model.language_model.",
             "base_model.model.language_model.model.")
_NAME = re.compile(r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?P<sub>self_attn|mlp)\."
                   r"(?P<module>[a-z_]+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass(frozen=True)
class BaseShapes:
    """The base model's dimensions an adapter must match (one tensor-parallel rank: the whole)."""

    hidden: int
    q: int  # num_attention_heads * head_dim
    kv: int  # num_kv_heads * head_dim
    inter: int  # intermediate_size
    num_layers: int

    def dim(self, which: str) -> int:
        return int(getattr(self, which))


@dataclass(frozen=True)
class AdapterSpec:
    """What read_adapter found: the adapter's rank and scaling, and its (layer, module) pairs
    with the safetensors names of their A [r, in] and B [out, r]."""

    path: str
    rank: int
    lora_alpha: float
    scaling: float
    weights_file: str
    modules: dict[tuple[int, str], tuple[str, str]] = field(default_factory=dict)
    file_size: int = 0
    file_mtime_ns: int = 0

    @property
    def target_modules(self) -> list[str]:
        return sorted({module for _, module in self.modules})


def _fail(path: str, why: str) -> InvalidLoRARequestError:
    return InvalidLoRARequestError(f"LoRA adapter {path!r}: {why}")


def _read_config(path: str) -> dict[str, Any]:
    config_file = Path(path) / CONFIG_FILE
    try:
        with open(config_file, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise _fail(path, f"no {CONFIG_FILE} (a PEFT adapter directory holds {CONFIG_FILE} and "
                          f"{WEIGHTS_FILE})") from None
    except OSError as error:
        raise _fail(path, f"{CONFIG_FILE} cannot be read ({error.strerror or error})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise _fail(path, f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise _fail(path, f"{CONFIG_FILE} is not JSON ({error})") from None
    if not isinstance(config, dict):
        raise _fail(path, f"{CONFIG_FILE} is not a JSON object")
    return config


def _number(config: dict[str, Any], key: str, path: str, default: Any = None) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _fail(path, f"{CONFIG_FILE} has {key}={value!r:.40}; it must be a positive number")
    return float(value)


def _check_config(config: dict[str, Any], path: str) -> tuple[int, float, float]:
    """(rank, lora_alpha, scaling) of a config this engine applies exactly as PEFT does."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _fail(path, f"peft_type is {peft_type!r:.40}; only LORA adapters are supported")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not supported",
        "layer_replication": "layer_replication is not supported",
    }
    for key, why in refused.items():
        if config.get(key):
            raise _fail(path, why)
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise _fail(path, f"bias={bias!r:.40}: adapters with trained biases are not supported (only bias='none')")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _fail(path, f"{CONFIG_FILE} has r={rank!r:.40}; it must be an int >= 1")
    alpha = _number(config, "lora_alpha", path, default=8)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, alpha, scaling


def _read_header(weights_file: Path, path: str) -> tuple[dict[str, Any], int, int, int]:
    """(tensor entries, data start, file size, mtime_ns) after the header's own checks."""
    try:
        with open(weights_file, "rb") as f:
            stat = os.fstat(f.fileno())
            size = stat.st_size
            header, header_len = read_header(f, size, MAX_HEADER_BYTES, _MAX_HEADER_DEPTH, WEIGHTS_FILE,
                                             f"{WEIGHTS_FILE}'s")
    except SafetensorsHeaderError as error:
        raise _fail(path, str(error)) from None
    except FileNotFoundError:
        raise _fail(path, f"no {WEIGHTS_FILE} (only the safetensors format is read)") from None
    except OSError as error:
        raise _fail(path, f"{WEIGHTS_FILE} cannot be read ({error.strerror or error})") from None
    if not isinstance(header, dict):
        raise _fail(path, f"{WEIGHTS_FILE}'s header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + header_len, size, stat.st_mtime_ns


def _check_entries(header: dict[str, Any], data_start: int, size: int, path: str) -> dict[str, list[int]]:
    """Each tensor's shape, once its dtype, shape and byte range are sound and the ranges tile
    the data exactly (no gap, no overlap, nothing past the end)."""
    shapes: dict[str, list[int]] = {}
    ranges: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise _fail(path, f"tensor {name!r:.80} has no header entry")
        shape, dtype, offsets = entry.get("shape"), entry.get("dtype"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise _fail(path, f"tensor {name!r:.80} has dtype {dtype!r:.20}; allowed: {sorted(DTYPE_BYTES)}")
        if not (isinstance(shape, list) and len(shape) == 2 and all(type(n) is int and n >= 1 for n in shape)):
            raise _fail(path, f"tensor {name!r:.80} has shape {shape!r:.80}; LoRA weights are 2-D")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int and n >= 0 for n in offsets)
                and offsets[0] <= offsets[1]):
            raise _fail(path, f"tensor {name!r:.80} has data_offsets {offsets!r:.80}")
        if offsets[1] - offsets[0] != shape[0] * shape[1] * DTYPE_BYTES[dtype]:
            raise _fail(path, f"tensor {name!r:.80} declares {offsets[1] - offsets[0]} bytes for shape {shape} "
                              f"of {dtype}")
        shapes[name] = shape
        ranges.append((offsets[0], offsets[1], name))
    ranges.sort()
    end = 0
    for begin, stop, name in ranges:
        if begin != end:
            raise _fail(path, f"tensor {name!r:.80}'s bytes {'overlap another' if begin < end else 'leave a gap'}")
        end = stop
    if data_start + end != size:
        raise _fail(path, f"{WEIGHTS_FILE} is {size} bytes but its header declares {data_start + end} "
                          "(truncated or padded)")
    return shapes


def read_adapter(path: str, base: BaseShapes, max_lora_rank: int) -> AdapterSpec:
    """The adapter at `path` checked against the base model and max_lora_rank; raises
    InvalidLoRARequestError saying what is wrong otherwise. Reads no tensor data."""
    if not os.path.isdir(path):
        raise _fail(path, "not a directory (a PEFT adapter directory holds adapter_config.json and "
                          "adapter_model.safetensors)")
    rank, alpha, scaling = _check_config(_read_config(path), path)
    if rank > max_lora_rank:
        raise _fail(path, f"its rank r={rank} exceeds max_lora_rank={max_lora_rank}; start the engine with "
                          f"--max-lora-rank {rank} or more")
    weights_file = Path(path) / WEIGHTS_FILE
    header, data_start, size, mtime_ns = _read_header(weights_file, path)
    shapes = _check_entries(header, data_start, size, path)
    if not shapes:
        raise _fail(path, f"{WEIGHTS_FILE} holds no tensors")
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for name, shape in shapes.items():
        match = _NAME.match(name)
        if (match is None or match["prefix"] not in _PREFIXES or match["module"] not in MODULES
                or MODULES[match["module"]][0] != match["sub"]):
            raise _fail(path, f"tensor {name!r:.100} is not one this engine applies: only lora_A/lora_B of "
                              f"{', '.join(MODULES)} in the decoder layers are supported")
        layer, module = int(match["layer"]), match["module"]
        if layer >= base.num_layers:
            raise _fail(path, f"tensor {name!r:.100} is for layer {layer}, but the base model has "
                              f"{base.num_layers} layers: the adapter was trained for another base model")
        _, in_dim, out_dim = MODULES[module]
        expected = [rank, base.dim(in_dim)] if match["ab"] == "A" else [base.dim(out_dim), rank]
        if shape != expected:
            raise _fail(path, f"tensor {name!r:.100} has shape {shape}, expected {expected} (r={rank} and the "
                              "base model's dimensions): the adapter was trained for another base model or its "
                              "config's r is wrong")
        pairs.setdefault((layer, module), {})[match["ab"]] = name
    modules: dict[tuple[int, str], tuple[str, str]] = {}
    for key, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise _fail(path, f"layer {key[0]} {key[1]} has lora_{'A' if 'A' in pair else 'B'} without its "
                              f"lora_{'B' if 'A' in pair else 'A'}")
        modules[key] = (pair["A"], pair["B"])
    return AdapterSpec(path=path, rank=rank, lora_alpha=alpha, scaling=scaling, weights_file=str(weights_file),
                       modules=modules, file_size=size, file_mtime_ns=mtime_ns)
