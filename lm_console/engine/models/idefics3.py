"""Idefics3 / SmolVLM: SigLIP tower -> pixel-shuffle connector -> Llama LM.

The tower (lm_console/engine/models/siglip.py) turns each image tile into patch features; the connector
folds each scale_factor x scale_factor block of patches into one vector (pixel shuffle) and
projects it to the LM's width, giving image_seq_len embeddings per tile. Those replace the
<image> tokens of the prompt (embed_input_ids); the LM is our paged Llama.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lm_console.engine.models.interfaces import merge_multimodal_embeddings
from lm_console.engine.models.layers import Linear
from lm_console.engine.models.llama import LlamaForCausalLM
from lm_console.engine.models.siglip import SiglipVisionTransformer, load_named


class Idefics3Connector(nn.Module):
    """pixel shuffle (seq, D) -> (seq / s^2, D * s^2), then a bias-free projection."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.scale_factor = int(config.scale_factor)
        vision_hidden = config.vision_config.hidden_size
        text_hidden = config.text_config.hidden_size
        self.modality_projection = nn.Module()
        self.modality_projection.proj = Linear(vision_hidden * self.scale_factor**2, text_hidden, False, dtype)

    def pixel_shuffle(self, x: Tensor) -> Tensor:
        batch, seq, dim = x.shape  # [B, h*w, D], square grid
        side, s = int(seq**0.5), self.scale_factor
        x = x.view(batch, side, side // s, dim * s)  # fold s columns into the channel dim
        x = x.permute(0, 2, 1, 3).reshape(batch, side // s, side // s, dim * s * s)  # then s rows
        return x.permute(0, 2, 1, 3).reshape(batch, seq // (s * s), dim * s * s)

    def forward(self, image_hidden_states: Tensor) -> Tensor:
        return self.modality_projection.proj(self.pixel_shuffle(image_hidden_states))


class Idefics3ForConditionalGeneration(nn.Module):
    """Vision-language model over a flat token batch (SupportsMultiModal)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype):
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.text_config = hf_config.text_config
        self.patch_size = int(hf_config.vision_config.patch_size)
        self.language_model = LlamaForCausalLM(self.text_config, dtype)
        self.vision_model = SiglipVisionTransformer(hf_config.vision_config, dtype)
        self.connector = Idefics3Connector(hf_config, dtype)

    # -- multimodal -------------------------------------------------------------------------
    def embed_multimodal(self, pixel_values: list[Tensor], pixel_attention_mask: list[Tensor] | None = None,
                         **_: Any) -> list[Tensor]:
        """Per image [tiles, 3, H, W] -> [tiles * image_seq_len, text_hidden]; all tiles run as one batch."""
        tiles_per_item = [int(p.shape[0]) for p in pixel_values]
        pixels = torch.cat(list(pixel_values)).to(self.dtype)  # [sum tiles, 3, H, W]
        if pixel_attention_mask is not None:
            pixel_mask = torch.cat(list(pixel_attention_mask)).bool()  # [sum tiles, H, W]
        else:
            pixel_mask = torch.ones(pixels.shape[0], *pixels.shape[2:], dtype=torch.bool, device=pixels.device)
        p = self.patch_size
        subgrid = pixel_mask.unfold(1, p, p).unfold(2, p, p)  # [N, H/p, W/p, p, p]
        patch_mask = subgrid.sum(dim=(-1, -2)) > 0  # [N, H/p, W/p]
        features = self.connector(self.vision_model(pixels, patch_mask))  # [N, seq, hidden]
        return [f.reshape(-1, f.shape[-1]) for f in features.split(tiles_per_item)]

    get_multimodal_embeddings = embed_multimodal

    def embed_input_ids(self, input_ids: Tensor, multimodal_embeddings: Tensor | None = None,
                        is_multimodal: Tensor | None = None) -> Tensor:
        embeds = self.language_model.embed_input_ids(input_ids)
        if multimodal_embeddings is None or is_multimodal is None or multimodal_embeddings.numel() == 0:
            return embeds
        return merge_multimodal_embeddings(embeds, multimodal_embeddings, is_multimodal)

    # -- text -------------------------------------------------------------------------------
    def forward(self, input_ids: Tensor, positions: Tensor, inputs_embeds: Tensor | None = None) -> Tensor:
        return self.language_model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        return self.language_model.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """HF names: model.text_model.* / lm_head.* -> LM; model.vision_model.*; model.connector.*."""
        text: list[tuple[str, Tensor]] = []
        vision: list[tuple[str, Tensor]] = []
        connector: list[tuple[str, Tensor]] = []
        for name, tensor in weights:
            name = name.removeprefix("model.") if not name.startswith("lm_head.") else name
            if name.startswith("text_model."):
                text.append(("model." + name.removeprefix("text_model."), tensor))
            elif name.startswith("lm_head."):
                text.append((name, tensor))
            elif name.startswith("vision_model."):
                vision.append((name.removeprefix("vision_model."), tensor))
            elif name.startswith("connector."):
                connector.append((name.removeprefix("connector."), tensor))
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        self.language_model.load_weights(text)
        for module, named, prefix in ((self.vision_model, vision, "vision_model"),
                                      (self.connector, connector, "connector")):
            missing = {n for n, _ in module.named_parameters()} - load_named(module, named)
            if missing:
                raise ValueError(f"checkpoint lacks {prefix} tensors, e.g. {sorted(missing)[:5]}")


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """SmolVLM(2): the Idefics3 architecture under its own name."""
