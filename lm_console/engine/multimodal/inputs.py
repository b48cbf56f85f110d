"""PlaceholderRange and MultiModalFeatureSpec (after vLLM's vllm/multimodal/inputs.py).

Both cross the frontend/engine-core boundary inside EngineCoreRequest, so they are msgspec
Structs. The processed tensors (`data`) are numpy arrays, which lm_console/engine/ipc.py sends as raw
frames; `data` is None when the processor cache says the engine core already holds them.
"""

from __future__ import annotations

from typing import Any

import msgspec


class PlaceholderRange(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Where one mm item's placeholder tokens sit in the prompt (after vLLM's PlaceholderRange).

    is_embed: one byte per placeholder position, 1 where an encoder embedding goes (Idefics3
    interleaves <image> tokens with row/column marker tokens); None means every position.
    """

    offset: int
    length: int
    is_embed: bytes | None = None

    def get_num_embeds(self) -> int:
        """Encoder embeddings this item produces (what the encoder cache counts)."""
        if self.is_embed is None:
            return self.length
        return self.is_embed.count(1)

    def embeds_before(self, position: int) -> int:
        """Embeddings among the first `position` placeholder positions (chunked prefill)."""
        position = max(0, min(position, self.length))
        if self.is_embed is None:
            return position
        return self.is_embed[:position].count(1)


class MultiModalFeatureSpec(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One multimodal item of a request (after vLLM's MultiModalFeatureSpec).

    identifier keys the encoder cache, the ECConnector and the prefix-cache extra keys;
    mm_hash is the content hash it derives from (they differ only when a LoRA prefixes it).
    offset/length/is_embed are the item's PlaceholderRange, flattened (see mm_position).
    data: the processed inputs of the item (e.g. {"pixel_values": ndarray}), None when the
    engine core's ProcessorCache receiver already holds them.
    """

    identifier: str
    offset: int
    length: int
    modality: str = "image"
    data: dict[str, Any] | None = None
    mm_hash: str | None = None
    is_embed: bytes | None = None

    @property
    def mm_position(self) -> PlaceholderRange:
        return PlaceholderRange(self.offset, self.length, self.is_embed)

    @property
    def num_embeds(self) -> int:
        """Encoder embeddings of this item (the unit of the encoder cache and budget)."""
        return self.length if self.is_embed is None else self.is_embed.count(1)
