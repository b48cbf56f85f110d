"""Building blocks shared by the decoder models: linear, embedding, RMSNorm, SiluAndMul, rotary.

Parameters are allocated uninitialised (`torch.empty`): every one is overwritten by
`load_weights`, and skipping random init saves most of the model build time.

The kernel choice lives here, not in the models: a layer with a fused CPU kernel
(lm_console/kernels/cpu_ops.py) picks it or its torch code once, at construction, for the dtype and the
device it is built on (`load_model` builds models in place on their device), so every model has
one forward. Build a layer on the device it runs on: moving it afterwards keeps its choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lm_console.engine.errors import UnsupportedArchitectureError
from lm_console.engine.models import lora
from lm_console.kernels import cpu_ops, cpu_quant


_weights_version = 0  # bumped when a layer's weights are swapped for others (see weights_version)


def weights_version() -> int:
    """A counter bumped whenever a layer's weights are replaced by other tensors (quantized
    weights attached): plans holding pointers into the weights (lm_console/engine/models/decode_stack.py)
    rebuild when it moves."""
    return _weights_version


def bump_weights_version() -> None:
    """Mark every plan holding weight pointers stale."""
    global _weights_version
    _weights_version += 1


def cpu_kernels_serve(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the fused C kernels serve layers of this dtype on this device: bf16 on the CPU,
    once the library is built; float32 keeps the exact torch path the HF-exactness tests compare."""
    return dtype == torch.bfloat16 and device.type == "cpu" and cpu_ops.load() is not None


class Linear(nn.Module):
    """y = x W^T (+ b), with W [out_features, in_features] as in HF checkpoints.

    On the CPU in bf16, `prepack_weight` gives oneDNN its own blocked copy of W (see
    lm_console/engine/models/prepack.py); forward then skips the per-call reorder of W. A quantized model
    (lm_console/engine/models/quant/) sets `quant` instead, and forward runs the int8 kernels.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        self.packed_weight: Tensor | None = None  # oneDNN layout; None: plain F.linear
        self.quant: cpu_quant.QuantWeight | None = None  # packed int8/int4 weights
        self.quant_bias: Tensor | None = None  # float32 copy of bias for the quantized kernels
        self.lora: lora.LoRASlots | None = None  # adapter slots (enable_lora; lm_console/engine/models/lora.py)

    def set_quant_weight(self, quant: cpu_quant.QuantWeight) -> None:
        """Run on the packed quantized weights from now on (the caller drops the dense W)."""
        self.quant = quant
        self.packed_weight = None
        self.quant_bias = None if self.bias is None else self.bias.detach().float().contiguous()
        bump_weights_version()

    def forward(self, x: Tensor) -> Tensor:
        if self.quant is not None:
            y = cpu_quant.quant_linear(x, self.quant, self.quant_bias)
        elif self.packed_weight is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        if self.lora is not None:  # the step's adapters' deltas beside the (possibly quantized) base
            return lora.add_delta(self.lora, x, y)
        return y


class LogitsProjection:
    """The lm_head as the sampler needs it: bf16/fp16 inputs, the top of each row in fp32.

    A bf16 matmul accumulates in fp32 but rounds its output to bf16 (8 bits of mantissa): two
    logits 0.1 apart near 16 can come out equal or swapped, so greedy choices then depend on the
    batch shape (a prefix-cache hit changes it). On CUDA, torch.mm(out_dtype=float32) keeps the
    whole output in fp32 when the build has it. Elsewhere the head runs at bf16 speed and only
    the logits that could be a row's maximum are recomputed in fp32: every logit within
    2 x REFINE_MARGIN x (the row's largest |logit|) of the rounded maximum (a bound on the
    rounding error, with room for the fp32 accumulation's own), each as one fp32 dot product of
    bf16 values whose order does not depend on the batch. The argmax (greedy) and the top
    logprobs are then those of fp32 logits; the other logits keep their bf16 rounding (a relative
    2^-9, which moves no sampling probability that matters). A full fp32 head measured 0.71x the
    engine's bf16 throughput on the embedded model; this costs a few dot products per row.
    """

    REFINE_MARGIN = 2.0 ** -7  # > bf16's relative rounding error 2^-9, with room to spare

    def __init__(self) -> None:
        self._mm_out_dtype = True  # try torch.mm(out_dtype=...) first on CUDA

    def __call__(self, hidden: Tensor, head: Linear) -> Tensor:
        """hidden [n, in] -> float32 logits [n, out] of this rank's head rows (a ParallelLMHead's
        caller gathers them: Linear.forward here, not the head's own gathering forward)."""
        weight = head.weight
        if head.quant is not None:  # packed weights: the kernel writes its float32 sums as they are
            return cpu_quant.quant_linear(hidden, head.quant, head.quant_bias, out_dtype=torch.float32)
        if weight.dtype == torch.float32:
            return F.linear(hidden.float(), weight, head.bias)
        if hidden.is_cuda and self._mm_out_dtype:
            try:
                logits = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
                return logits if head.bias is None else logits + head.bias.float()
            except (RuntimeError, TypeError, NotImplementedError):
                self._mm_out_dtype = False  # this build lacks it: refine the top instead
        logits = Linear.forward(head, hidden).float()
        if logits.numel() == 0:
            return logits
        low, high = torch.aminmax(logits, dim=-1, keepdim=True)  # one pass: max and max |logit|
        margin = 2 * self.REFINE_MARGIN * torch.maximum(high, -low)
        rows, cols = torch.nonzero(logits >= high - margin, as_tuple=True)
        exact = (hidden[rows].float() * weight[cols].float()).sum(dim=-1)
        if head.bias is not None:
            exact = exact + head.bias[cols].float()
        logits[rows, cols] = exact
        return logits


class Embedding(nn.Module):
    """Token id -> row of weight [vocab_size, hidden_size]."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.quant: cpu_quant.QuantWeight | None = None  # packed rows (quantized models)

    def set_quant_weight(self, quant: cpu_quant.QuantWeight) -> None:
        """Look rows up in packed quantized weights from now on (the caller drops the dense W)."""
        self.quant = quant
        bump_weights_version()

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.quant is not None:
            return cpu_quant.embedding_rows(self.quant, input_ids, self.weight.dtype)
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 and cast back (as HF Llama does).

    bf16 rows on CPU go through one fused C pass (lm_console/kernels/cpu_ops.py) that rounds once at the
    end instead of after the cast and after the weight multiply; float32 stays on torch, exact.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.use_cpu_kernels = cpu_kernels_serve(dtype, self.weight.device)

    def forward(self, x: Tensor) -> Tensor:
        """x [T, hidden_size] -> normalised rows (a new tensor)."""
        if self.use_cpu_kernels:
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        return self._torch_norm(x)

    def add_and_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(norm(x + residual), x + residual): the residual add before a pre-norm, fused.

        The fused kernel writes the sum into x's storage (x must be a temporary the caller
        owns, e.g. a sublayer's output); residual is only read.
        """
        if self.use_cpu_kernels:
            return cpu_ops.add_rms_norm_(x, residual, self.weight, self.eps), x
        residual = x + residual
        return self._torch_norm(residual), residual

    def norm_heads_(self, x: Tensor, num_heads: int) -> None:
        """Normalise each of the first num_heads heads (of hidden_size each) of the rows
        x [T, >= num_heads * hidden_size] in place: Qwen3's q/k norm inside the fused qkv."""
        if self.use_cpu_kernels:
            cpu_ops.rms_norm_heads_(x, num_heads, self.weight.shape[0], self.weight, self.eps)
            return
        heads = x[:, : num_heads * self.weight.shape[0]].view(x.shape[0], num_heads, -1)
        heads.copy_(self._torch_norm(heads))

    def _torch_norm(self, x: Tensor) -> Tensor:
        # torch's fused kernel gives the same float32 result as pow/mean/rsqrt, in fewer passes.
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)


class SiluAndMul(nn.Module):
    """SwiGLU's activation: [T, 2I] gate | up -> [T, I] silu(gate) * up (one fused pass in bf16)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.use_cpu_kernels = cpu_kernels_serve(dtype, torch.get_default_device())

    def forward(self, x: Tensor) -> Tensor:
        if self.use_cpu_kernels:
            return cpu_ops.silu_and_mul(x)
        gate, up = x.split(x.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up


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


@dataclass(slots=True)
class RopeAngles:
    """cos and sin of one step's positions, laid out for the kernel that rotates q and k; the
    model computes them once per forward (RotaryEmbedding) and every layer rotates with them."""

    cos: Tensor  # CPU kernel: [T, head_dim // 2] float32 rows; torch: [T, 1, head_dim // 2], model dtype
    sin: Tensor
    use_cpu_kernels: bool

    def rotate(self, qkv: Tensor, num_heads: int, num_kv_heads: int) -> tuple[Tensor, Tensor]:
        """Neox rope on the q and k heads leading the rows qkv [T, >= (H + Hkv) * D].

        Returns q [T, H * D] and k [T, Hkv * D]: views of qkv rotated in place by the fused
        kernel (one pass over both), or new tensors from the torch path.
        """
        num_tokens, head_dim = qkv.shape[0], 2 * self.cos.shape[-1]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        if self.use_cpu_kernels:
            cpu_ops.rotary_neox_(qkv, num_heads + num_kv_heads, head_dim, self.cos, self.sin)
            return qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
        qk = qkv[:, : q_size + kv_size].view(num_tokens, num_heads + num_kv_heads, head_dim)
        qk = apply_rotary(qk, self.cos, self.sin)  # [T, H + Hkv, D], one pass for q and k
        return qk[:, :num_heads].reshape(num_tokens, q_size), qk[:, num_heads:].reshape(num_tokens, kv_size)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), cos/sin tables precomputed in float32."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any], dtype: torch.dtype):
        super().__init__()
        inv_freq = _inv_freq(head_dim, params, max_position)  # [head_dim // 2]
        freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
        # [max_position, head_dim // 2] each; not saved in checkpoints
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.dtype = dtype  # the model's: q and k are rotated in it
        self.use_cpu_kernels = cpu_kernels_serve(dtype, freqs.device)

    def forward(self, positions: Tensor) -> RopeAngles:
        """The angles of positions [T], in the layout of this layer's kernel."""
        if self.use_cpu_kernels:  # float32 rows, read by the fused in-place kernel
            return RopeAngles(self.cos.index_select(0, positions), self.sin.index_select(0, positions), True)
        return RopeAngles(self.cos[positions, None].to(self.dtype), self.sin[positions, None].to(self.dtype), False)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] by its positions' angles (new tensor)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
