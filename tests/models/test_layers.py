"""The shared layers pick their kernel once, at construction (lm_console/engine/models/layers.py), and both
choices compute the same thing: the models have one forward whatever the kernel."""

from __future__ import annotations

import pytest
import torch

from lm_console.engine.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul, apply_rotary
from lm_console.kernels import cpu_ops

needs_kernels = pytest.mark.skipif(cpu_ops.load() is None,
                                   reason="no C compiler (or LMC_CPU_KERNELS=0): torch path only")
HEADS, KV_HEADS, HEAD_DIM, TOKENS = 4, 2, 16, 5


def _layers(dtype: torch.dtype) -> tuple[RMSNorm, SiluAndMul, RotaryEmbedding]:
    return (RMSNorm(HEAD_DIM, 1e-6, dtype), SiluAndMul(dtype),
            RotaryEmbedding(HEAD_DIM, 64, {"rope_type": "default", "rope_theta": 10000.0}, dtype))


def test_float32_and_hidden_kernels_choose_torch(monkeypatch) -> None:
    assert not any(layer.use_cpu_kernels for layer in _layers(torch.float32))
    monkeypatch.setattr(cpu_ops, "load", lambda: None)  # no compiler, or LMC_CPU_KERNELS=0
    assert not any(layer.use_cpu_kernels for layer in _layers(torch.bfloat16))


@needs_kernels
def test_bf16_on_the_cpu_chooses_the_fused_kernels() -> None:
    assert all(layer.use_cpu_kernels for layer in _layers(torch.bfloat16))


def _qkv(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(TOKENS, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)


def test_torch_rope_and_head_norm_match_the_reference() -> None:
    """float32: q/k norm in place inside qkv, then rope of the q and k heads, op for op."""
    norm, _, rotary = _layers(torch.float32)
    norm.weight.copy_(torch.linspace(0.5, 1.5, HEAD_DIM))
    qkv = _qkv(torch.float32)
    positions = torch.tensor([0, 3, 7, 8, 20])
    heads = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(TOKENS, HEADS + KV_HEADS, HEAD_DIM)
    normed = norm.weight * torch.nn.functional.rms_norm(heads, (HEAD_DIM,), eps=1e-6)
    cos, sin = rotary.cos[positions, None], rotary.sin[positions, None]
    expected = apply_rotary(normed, cos, sin)
    norm.norm_heads_(qkv, HEADS + KV_HEADS)
    q, k = rotary(positions).rotate(qkv, HEADS, KV_HEADS)
    assert torch.equal(q, expected[:, :HEADS].reshape(TOKENS, -1))
    assert torch.equal(k, expected[:, HEADS:].reshape(TOKENS, -1))


@needs_kernels
def test_fused_and_torch_layers_agree_in_bf16(monkeypatch) -> None:
    """The choice made at construction sticks: each set of layers keeps its own kernels."""
    fused = _layers(torch.bfloat16)
    with monkeypatch.context() as patch:  # hidden while the torch layers are built, then back
        patch.setattr(cpu_ops, "load", lambda: None)
        plain = _layers(torch.bfloat16)
    assert not any(layer.use_cpu_kernels for layer in plain)
    positions = torch.tensor([0, 3, 7, 8, 20])
    qkv_fused, qkv_plain = _qkv(torch.bfloat16), _qkv(torch.bfloat16)
    fused[0].norm_heads_(qkv_fused, HEADS)
    plain[0].norm_heads_(qkv_plain, HEADS)
    q_f, k_f = fused[2](positions).rotate(qkv_fused, HEADS, KV_HEADS)
    q_p, k_p = plain[2](positions).rotate(qkv_plain, HEADS, KV_HEADS)
    assert q_f.data_ptr() == qkv_fused.data_ptr()  # the kernel rotates in place: q is a view
    torch.testing.assert_close(q_f, q_p, atol=0.05, rtol=0.02)
    torch.testing.assert_close(k_f, k_p, atol=0.05, rtol=0.02)
    gate_up = _qkv(torch.bfloat16)[:, : 4 * HEAD_DIM]
    torch.testing.assert_close(fused[1](gate_up), plain[1](gate_up), atol=0.05, rtol=0.02)
