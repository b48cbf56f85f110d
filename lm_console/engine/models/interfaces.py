"""SupportsMultiModal: what the worker's encoder path needs from a vision-language model.

The two methods follow vLLM's SupportsMultiModal: embed_multimodal and embed_input_ids.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class SupportsMultiModal(Protocol):
    """A model whose prompt may hold encoder outputs (images) in place of some tokens."""

    def embed_multimodal(self, **kwargs: Any) -> list[Tensor]:
        """Encoder outputs, one [num_embeds, hidden_size] tensor per item, in input order.

        kwargs: the items' processed arrays batched by key, each a list with one tensor per
        item (e.g. pixel_values=[[tiles, 3, H, W], ...]).
        """
        ...

    def embed_input_ids(self, input_ids: Tensor, multimodal_embeddings: Tensor | None = None,
                        is_multimodal: Tensor | None = None) -> Tensor:
        """Token embeddings with the positions of is_multimodal replaced by the mm embeddings."""
        ...


def supports_multimodal(model: Any) -> bool:
    return isinstance(model, SupportsMultiModal)


def merge_multimodal_embeddings(inputs_embeds: Tensor, multimodal_embeddings: Tensor,
                                is_multimodal: Tensor) -> Tensor:
    """masked_scatter_ the mm embeddings (in order) into the True rows."""
    num_rows = int(is_multimodal.sum())
    if num_rows != multimodal_embeddings.shape[0]:
        raise RuntimeError(f"{num_rows} multimodal positions but {multimodal_embeddings.shape[0]} "
                           "embeddings to place")
    inputs_embeds.masked_scatter_(is_multimodal.unsqueeze(-1),
                                  multimodal_embeddings.to(dtype=inputs_embeds.dtype))
    return inputs_embeds


def empty_embeddings(hidden_size: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.empty(0, hidden_size, dtype=dtype, device=device)
