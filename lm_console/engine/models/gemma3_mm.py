"""Gemma3 vision path: SigLIP tower -> multimodal projector -> masked_scatter into the text embeddings.

transformers' modeling_gemma3 is the reference:
- the tower is SigLIP (lm_console/engine/models/siglip.py) on a fixed-size image (no NaViT mask), and its
  last hidden state (not the pooled head) feeds the projector;
- Gemma3MultiModalProjector: the patches_per_side^2 patch features are average-pooled on their
  grid down to mm_tokens_per_image (kernel = patches_per_side / sqrt(mm_tokens_per_image)),
  Gemma-RMS-normalised (`mm_soft_emb_norm`, (1 + weight), vision layer_norm_eps), then
  multiplied by `mm_input_projection_weight` [vision_hidden, text_hidden] (a matmul, not a Linear);
- the text embeddings are scaled by sqrt(hidden_size); the image embeddings replace the
  <image_soft_token> rows unscaled (HF scatters the projector output after the scaled lookup).
Attention among one image's tokens is bidirectional in the language model (HF's token_type_ids
mask): the model says so with `mm_bidirectional_attention`, and the model runner passes the
image spans to the attention backend (EncoderRunner.bidirectional_spans, torch_backend).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lm_console.engine.models.gemma3 import Gemma3ForConditionalGeneration, GemmaRMSNorm
from lm_console.engine.models.interfaces import merge_multimodal_embeddings
from lm_console.engine.models.siglip import SiglipVisionTransformer, load_named

# Vision-side checkpoint prefixes: transformers 5 saves `model.vision_tower.*` (the tower's own
# modules), released checkpoints `vision_tower.vision_model.*`.
_TOWER_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
                   "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class Gemma3MultiModalProjector(nn.Module):
    """[B, patches, vision_hidden] -> AvgPool on the patch grid -> Gemma RMSNorm -> @ W
    -> [B, mm_tokens, text_hidden] (HF: Gemma3MultiModalProjector)."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        vision, text = config.vision_config, config.get_text_config()
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, text.hidden_size, dtype=dtype), requires_grad=False)
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps, dtype)
        self.patches_per_side = int(vision.image_size) // int(vision.patch_size)
        tokens_per_side = int(int(config.mm_tokens_per_image) ** 0.5)
        if tokens_per_side**2 != int(config.mm_tokens_per_image) or self.patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image={config.mm_tokens_per_image} must be a square whose side divides "
                             f"the {self.patches_per_side} patches per side")
        self.kernel_size = self.patches_per_side // tokens_per_side

    def forward(self, vision_outputs: Tensor) -> Tensor:
        batch, _, hidden = vision_outputs.shape
        side = self.patches_per_side
        grid = vision_outputs.transpose(1, 2).reshape(batch, hidden, side, side)  # row-major patches
        pooled = F.avg_pool2d(grid, self.kernel_size, self.kernel_size).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled)  # [B, mm_tokens, vision_hidden]
        return torch.matmul(normed, self.mm_input_projection_weight).to(vision_outputs.dtype)


class Gemma3VLForConditionalGeneration(Gemma3ForConditionalGeneration):
    """Gemma3 VLM over a flat token batch: the hybrid Gemma3 LM plus the SigLIP tower and projector."""

    # Tokens of one image attend to each other both ways (HF: token_type_ids block mask).
    mm_bidirectional_attention = True

    def __init__(self, hf_config: Any, dtype: torch.dtype):
        super().__init__(hf_config, dtype)
        self.image_token_id = int(getattr(hf_config, "image_token_id", None)
                                  or getattr(hf_config, "image_token_index"))
        self.vision_tower = SiglipVisionTransformer(hf_config.vision_config, dtype)
        self.multi_modal_projector = Gemma3MultiModalProjector(hf_config, dtype)

    # -- multimodal -------------------------------------------------------------------------
    def embed_multimodal(self, pixel_values: list[Tensor], **_: Any) -> list[Tensor]:
        """Per item [crops, 3, H, W] -> [crops * mm_tokens_per_image, text_hidden]; one tower batch."""
        crops_per_item = [int(p.shape[0]) for p in pixel_values]
        pixels = torch.cat(list(pixel_values)).to(self.dtype)  # [sum crops, 3, H, W]
        features = self.multi_modal_projector(self.vision_tower(pixels))  # [N, mm_tokens, hidden]
        return [f.reshape(-1, f.shape[-1]) for f in features.split(crops_per_item)]

    get_multimodal_embeddings = embed_multimodal

    def embed_input_ids(self, input_ids: Tensor, multimodal_embeddings: Tensor | None = None,
                        is_multimodal: Tensor | None = None) -> Tensor:
        """Scaled text embeddings with the image rows replaced by the (unscaled) image embeddings."""
        if multimodal_embeddings is None or is_multimodal is None or multimodal_embeddings.numel() == 0:
            return self.model.embed_input_ids(input_ids)
        # Released checkpoints keep the image token inside the vocabulary; mask it anyway so an
        # out-of-vocabulary placeholder id (as HF guards against) never indexes the table.
        safe_ids = torch.where(is_multimodal, torch.zeros_like(input_ids), input_ids)
        embeds = self.model.embed_input_ids(safe_ids)
        return merge_multimodal_embeddings(embeds, multimodal_embeddings, is_multimodal)

    # -- weights ----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Language model tensors go to the text path; the tower and projector load here.

        The SigLIP pooling head (`head.*`, present when vision_use_head is on) is unused by
        Gemma3 (it reads the tower's last hidden state) and skipped.
        """
        tower: list[tuple[str, Tensor]] = []
        projector: list[tuple[str, Tensor]] = []

        def text_weights() -> Iterable[tuple[str, Tensor]]:
            for name, tensor in weights:
                if name.startswith(_PROJECTOR_PREFIXES):
                    projector.append((_strip(name, _PROJECTOR_PREFIXES), tensor))
                elif name.startswith(_TOWER_PREFIXES):
                    name = _strip(name, _TOWER_PREFIXES)
                    if not name.startswith("head."):
                        tower.append((name, tensor))
                else:
                    yield name, tensor

        super().load_weights(text_weights())
        for module, named, prefix in ((self.vision_tower, tower, "vision_tower"),
                                      (self.multi_modal_projector, projector, "multi_modal_projector")):
            missing = {n for n, _ in module.named_parameters()} - load_named(module, named)
            if missing:
                raise ValueError(f"checkpoint lacks {prefix} tensors, e.g. {sorted(missing)[:5]}")

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        # The language model's check; the tower and projector are checked in load_weights.
        text_params = {n: p for n, p in params.items()
                       if not n.startswith(("vision_tower.", "multi_modal_projector."))}
        super()._check_all_loaded(text_params, loaded)


def _strip(name: str, prefixes: tuple[str, ...]) -> str:
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name
