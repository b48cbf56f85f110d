"""Building blocks shared by the decoder models: linear, embedding, RMSNorm, rotary embedding.

Parameters are allocated uninitialised (`torch.empty`): every one is overwritten by
`load_weights`, and skipping random init saves most of the model build time.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.errors import UnsupportedArchitectureError
from kernels import cpu_ops


class Linear(nn.Module):
    """y = x W^T (+ b), with W [out_features, in_features] as in HF checkpoints.

    On the CPU in bf16, `prepack_weight` gives oneDNN its own blocked copy of W (see
    engine/models/prepack.py); forward then skips the per-call reorder of W.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        self.packed_weight: Tensor | None = None  # oneDNN layout; None: plain F.linear

    def forward(self, x: Tensor) -> Tensor:
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token id -> row of weight [vocab_size, hidden_size]."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 and cast back (as HF Llama does).

    bf16 rows on CPU go through one fused C pass (kernels/cpu_ops.py) that rounds once at the
    end instead of after the cast and after the weight multiply; float32 stays on torch, exact.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2 and cpu_ops.enabled(x):
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        return self._torch_norm(x)

    def add_and_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(norm(x + residual), x + residual): the residual add before a pre-norm, fused.

        The fused kernel writes the sum into x's storage (x must be a temporary the caller
        owns, e.g. a sublayer's output); residual is only read.
        """
        if x.dim() == 2 and cpu_ops.enabled(x):
            return cpu_ops.add_rms_norm_(x, residual, self.weight, self.eps), x
        residual = x + residual
        return self._torch_norm(residual), residual

    def _torch_norm(self, x: Tensor) -> Tensor:
        # torch's fused kernel gives the same float32 result as pow/mean/rsqrt, in fewer passes.
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE settings of an HF config: rope_type, rope_theta and the scaling fields.

    transformers 5 keeps them all in `config.rope_parameters`; older versions use
    `config.rope_theta` plus an optional `config.rope_scaling` dict ("type" or "rope_type").
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params.update(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def _inv_freq(head_dim: int, params: dict[str, Any], max_position: int) -> Tensor:
    """Inverse frequencies [head_dim // 2] (float32) for the config's rope type."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        original = float(params.get("original_max_position_embeddings", max_position))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(in_band, blended, scaled)
    raise UnsupportedArchitectureError(
        f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3"
    )


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), cos/sin tables precomputed in float32."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]):
        super().__init__()
        inv_freq = _inv_freq(head_dim, params, max_position)  # [head_dim // 2]
        freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
        # [max_position, head_dim // 2] each; not saved in checkpoints
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [num_tokens, 1, head_dim // 2] in `dtype` for the given positions."""
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)

    def tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [num_tokens, head_dim // 2] float32 rows: the fused kernel's inputs."""
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


def uses_rope_tables(x: Tensor, cos: Tensor) -> bool:
    """Whether rope on rows x goes through the fused in-place kernel (`cpu_ops.rotary_neox_`).

    It does for bf16 CPU rows given `RotaryEmbedding.tables`' float32 [T, D/2] rows, which
    LlamaModel passes exactly when the fused kernels are on (else [T, 1, D/2] in x's dtype).
    """
    return cos.dim() == 2 and cos.dtype == torch.float32 and cpu_ops.enabled(x)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] by its positions' angles (new tensor)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
