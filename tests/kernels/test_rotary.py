"""In-place rotary embedding (neox and gpt-j pairings) against the float64 reference."""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import DEVICE, ON_GPU, REL_TOL, rel_err
from lm_console.kernels.rotary import rotary_embedding, rotary_embedding_ref

NUM_TOKENS, HEADS, KV_HEADS, HEAD_DIM = (4096, 32, 8, 128) if ON_GPU else (7, 4, 2, 16)


def _tables(rotary_dim: int, max_position: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim)
    freqs = torch.outer(torch.arange(max_position).double(), inv_freq)
    return freqs.cos().float().to(DEVICE), freqs.sin().float().to(DEVICE)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype,rotary_dim", [(torch.float32, HEAD_DIM),
                                              (torch.bfloat16, HEAD_DIM // 2)])
def test_rotary_in_place(is_neox, dtype, rotary_dim):
    # q and k are strided views of one fused qkv output, as in the model.
    qkv = torch.randn(NUM_TOKENS, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=DEVICE).to(dtype)
    q = qkv[:, : HEADS * HEAD_DIM].view(NUM_TOKENS, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM]
    k = k.view(NUM_TOKENS, KV_HEADS, HEAD_DIM)
    v_before = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].clone()
    positions = torch.randint(0, 8192, (NUM_TOKENS,), device=DEVICE)
    cos, sin = _tables(rotary_dim)
    q_ref = rotary_embedding_ref(positions, q, cos, sin, is_neox)
    k_ref = rotary_embedding_ref(positions, k, cos, sin, is_neox)
    rotary_embedding(positions, q, k, cos, sin, is_neox)
    assert rel_err(q, q_ref) < REL_TOL[dtype]
    assert rel_err(k, k_ref) < REL_TOL[dtype]
    assert torch.equal(qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :], v_before)  # v untouched
