"""Build one of our model classes and fill it from a Hugging Face safetensors directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from engine.distributed.parallel_state import get_tp_group
from engine.errors import ModelNotFoundError
from engine.models.parallel_layers import LazyWeight
from engine.models.prepack import prepack_linears
from engine.models.registry import get_model_class


# Checkpoint names of replicated towers: read whole even under tensor parallelism.
_REPLICATED_PREFIXES = ("vision", "model.vision", "multi_modal_projector", "model.multi_modal_projector",
                        "model.connector", "connector")


def iterate_safetensors(model_dir: Path, lazy: bool = False) -> Iterator[tuple[str, Tensor | LazyWeight]]:
    """(name, tensor) for every tensor of every *.safetensors file in the directory.

    lazy (tensor parallelism): the language model's tensors come as LazyWeight slices, so each
    rank reads only its rows or columns from disk; replicated towers still come whole.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if lazy and not name.startswith(_REPLICATED_PREFIXES):
                    yield name, LazyWeight(f.get_slice(name))
                else:
                    yield name, f.get_tensor(name)


def load_model(model_dir: Path, hf_config: Any, dtype: torch.dtype,
               device: torch.device | str) -> nn.Module:
    """Our model for hf_config, weights from model_dir, on `device` in `dtype`, eval, no grad."""
    model_cls = get_model_class(hf_config)
    with torch.device(device), torch.no_grad():
        model = model_cls(hf_config, dtype)
        model.load_weights(iterate_safetensors(Path(model_dir), lazy=get_tp_group().world_size > 1))
        prepack_linears(model)
    model.requires_grad_(False)
    return model.eval()
