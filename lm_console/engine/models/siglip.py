"""SigLIP vision tower, shared by Idefics3 and Gemma3.

A ViT with bidirectional attention: Conv2d patch embedding + learned position embedding, N
pre-norm encoder layers (LayerNorm -> attention -> LayerNorm -> MLP), a final LayerNorm.
Module names follow HF's `SiglipVisionTransformer` (`vision_model.*` in checkpoints).
Variable-resolution inputs (Idefics3's NaViT variant) pass a patch_attention_mask: position
ids are then bucketised fractional coordinates and padded patches are masked out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lm_console.engine.models.layers import Linear

_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias, parameters uninitialised until load_weights."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class SiglipVisionEmbeddings(nn.Module):
    """pixels [B, C, H, W] -> patch embeddings + position embeddings [B, num_patches, D]."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.patch_size = config.patch_size
        self.num_patches_per_side = config.image_size // config.patch_size
        self.num_positions = self.num_patches_per_side**2
        hidden = config.hidden_size
        self.patch_embedding = nn.Conv2d(config.num_channels, hidden, self.patch_size, self.patch_size,
                                         dtype=dtype)
        self.position_embedding = nn.Embedding(self.num_positions, hidden, dtype=dtype)

    def forward(self, pixel_values: Tensor, patch_attention_mask: Tensor | None = None) -> Tensor:
        batch = pixel_values.shape[0]
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        embeddings = patches.flatten(2).transpose(1, 2)  # [B, h*w, D]
        if patch_attention_mask is None:
            position_ids = torch.arange(embeddings.shape[1], device=embeddings.device).expand(batch, -1)
        else:
            position_ids = self._bucketized_position_ids(patch_attention_mask)
        return embeddings + self.position_embedding(position_ids)

    def _bucketized_position_ids(self, mask: Tensor) -> Tensor:
        """NaViT position ids: each real patch's fractional (row, col) mapped onto the
        num_patches_per_side grid; padded patches get id 0 (they are masked anyway)."""
        batch, max_h, max_w = mask.shape
        side = self.num_patches_per_side
        boundaries = torch.arange(1 / side, 1.0, 1 / side, device=mask.device)
        step_h = 1.0 / mask[:, :, 0].sum(dim=1)  # [B]
        step_w = 1.0 / mask[:, 0, :].sum(dim=1)
        rows = torch.arange(max_h, device=mask.device, dtype=torch.float32)
        cols = torch.arange(max_w, device=mask.device, dtype=torch.float32)
        frac_h = torch.clamp(rows[None, :] * step_h[:, None], max=1.0 - 1e-6)
        frac_w = torch.clamp(cols[None, :] * step_w[:, None], max=1.0 - 1e-6)
        bucket_h = torch.bucketize(frac_h, boundaries, right=True)
        bucket_w = torch.bucketize(frac_w, boundaries, right=True)
        ids = (bucket_h[:, :, None] * side + bucket_w[:, None, :]).reshape(batch, -1)
        return torch.where(mask.reshape(batch, -1), ids, torch.zeros_like(ids))


class SiglipAttention(nn.Module):
    """Bidirectional multi-head attention with separate q/k/v/out projections (biased)."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.q_proj = Linear(hidden, hidden, True, dtype)
        self.k_proj = Linear(hidden, hidden, True, dtype)
        self.v_proj = Linear(hidden, hidden, True, dtype)
        self.out_proj = Linear(hidden, hidden, True, dtype)

    def forward(self, x: Tensor, attn_mask: Tensor | None) -> Tensor:
        batch, seq, hidden = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, S, D]

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)),
                                             heads(self.v_proj(x)), attn_mask=attn_mask)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, hidden))


class SiglipMLP(nn.Module):
    """fc2(act(fc1(x)))."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.act = _ACTIVATIONS[config.hidden_act]
        self.fc1 = Linear(config.hidden_size, config.intermediate_size, True, dtype)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size, True, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    """x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        eps = config.layer_norm_eps
        self.layer_norm1 = LayerNorm(config.hidden_size, eps, dtype)
        self.self_attn = SiglipAttention(config, dtype)
        self.layer_norm2 = LayerNorm(config.hidden_size, eps, dtype)
        self.mlp = SiglipMLP(config, dtype)

    def forward(self, x: Tensor, attn_mask: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x), attn_mask)
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config, dtype)
                                    for _ in range(config.num_hidden_layers))

    def forward(self, x: Tensor, attn_mask: Tensor | None) -> Tensor:
        for layer in self.layers:
            x = layer(x, attn_mask)
        return x


class SiglipVisionTransformer(nn.Module):
    """pixel_values [B, C, H, W] -> last hidden states [B, num_patches, D] (post-LayerNorm)."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.embeddings = SiglipVisionEmbeddings(config, dtype)
        self.encoder = SiglipEncoder(config, dtype)
        self.post_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)

    def forward(self, pixel_values: Tensor, patch_attention_mask: Tensor | None = None) -> Tensor:
        hidden = self.embeddings(pixel_values, patch_attention_mask)
        attn_mask = None
        if patch_attention_mask is not None and not bool(patch_attention_mask.all()):
            keys = patch_attention_mask.reshape(hidden.shape[0], 1, 1, -1)  # [B, 1, 1, S] bool
            attn_mask = keys
        return self.post_layernorm(self.encoder(hidden, attn_mask))

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Copy `vision_model.`-relative HF tensors in; returns the names loaded."""
        return load_named(self, weights)


def load_named(module: nn.Module, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
    """Copy tensors into module parameters of the same name and shape; returns loaded names."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(module).__name__}")
        param = params[name]
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
        param.data.copy_(tensor)
        loaded.add(name)
    return loaded
