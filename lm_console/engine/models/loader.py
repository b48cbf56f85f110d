"""Build one of our model classes and fill it from a Hugging Face safetensors directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from lm_console.engine.distributed.parallel_state import get_tp_group
from lm_console.engine.errors import ModelNotFoundError
from lm_console.engine.models.parallel_layers import LazyWeight
from lm_console.engine.models.prepack import prepack_linears
from lm_console.engine.models.registry import get_model_class


# Checkpoint names of replicated towers: read whole even under tensor parallelism.
_REPLICATED_PREFIXES = ("vision", "model.vision", "multi_modal_projector", "model.multi_modal_projector",
                        "model.connector", "connector")


def iterate_safetensors(model_dir: Path, skip: frozenset[str] = frozenset(),
                        lazy: bool = False) -> Iterator[tuple[str, Tensor | LazyWeight]]:
    """(name, tensor) for every tensor of every *.safetensors file in the directory.

    Tensors named in `skip` are not read: a zero-stride stand-in of their shape takes their
    place (their destination is a `meta` placeholder already replaced by quantized weights).
    lazy (tensor parallelism): the language model's tensors come as LazyWeight slices, so each
    rank reads only its rows or columns from disk; replicated towers still come whole.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in skip:
                    yield name, torch.zeros(()).expand(f.get_slice(name).get_shape())
                elif lazy and not name.startswith(_REPLICATED_PREFIXES):
                    yield name, LazyWeight(f.get_slice(name))
                else:
                    yield name, f.get_tensor(name)


def load_model(model_dir: Path, hf_config: Any, dtype: torch.dtype,
               device: torch.device | str, quantization: str | None = None) -> nn.Module:
    """Our model for hf_config, weights from model_dir, on `device` in `dtype`, eval, no grad.

    quantization ("int8" | "gguf", see lm_console/engine/models/quant/) swaps the linears' dense weights
    for packed quantized ones after the load; "gguf" reads the file model_dir was converted from.
    """
    model_cls = get_model_class(hf_config)
    with torch.device(device), torch.no_grad():
        model = model_cls(hf_config, dtype)
        if quantization == "gguf":  # packed weights first: their dense copies are never read
            from lm_console.engine.models.embedded import gguf_source
            from lm_console.engine.models.quant import quantize_model, quantized_checkpoint_names, refresh_biases

            quantize_model(model, quantization, gguf_source(model_dir), cache_dir=Path(model_dir))
            model.load_weights(iterate_safetensors(Path(model_dir), quantized_checkpoint_names(model)))
            refresh_biases(model)
        else:
            model.load_weights(iterate_safetensors(Path(model_dir), lazy=get_tp_group().world_size > 1))
            if quantization is not None:
                from lm_console.engine.models.quant import quantize_model

                quantize_model(model, quantization)
        prepack_linears(model)  # the linears left dense
    model.requires_grad_(False)
    return model.eval()
