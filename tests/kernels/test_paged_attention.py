"""The unified paged-attention kernel against its float64 reference (lm_console/kernels/paged_attention.py)."""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import DEVICE, ON_GPU, REL_TOL, make_paged_batch, rel_err
from lm_console.kernels.paged_attention import paged_attention, paged_attention_ref

# (num_context, query_len) per request: prefills with and without cached context, decodes.
if ON_GPU:  # real sizes: 32 query heads over 8 KV heads of 128, contexts up to 4k
    HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
    MIXED = [(0, 700), (1500, 1), (3000, 1), (900, 300), (0, 1), (4000, 1), (2047, 513)]
    MIXED += [(n, 1) for n in range(17, 4096, 257)]
else:  # the interpreter: small, still ragged and multi-tile
    HEADS, KV_HEADS, HEAD_DIM = 8, 2, 32
    MIXED = [(0, 37), (20, 1), (33, 17), (0, 1), (147, 1), (5, 40), (64, 1), (15, 2)]
BLOCK_SIZE = 16


def _run(requests, dtype, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, window=None,
         soft_cap=None, seed=0):
    q, k_cache, v_cache, table, qsl, seq_lens = make_paged_batch(
        requests, heads, kv_heads, head_dim, BLOCK_SIZE, dtype, seed)
    out = torch.full_like(q, float("nan"))  # poison: every row must be written
    scale = head_dim**-0.5
    paged_attention(q, k_cache, v_cache, table, qsl, seq_lens, scale,
                    max_query_len=max(n for _, n in requests), sliding_window=window,
                    soft_cap=soft_cap, out=out)
    ref = paged_attention_ref(q, k_cache, v_cache, table, qsl, seq_lens, scale, window, soft_cap)
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_batch_matches_reference(dtype):
    """Shuffled blocks, ragged lengths, GQA; fp32/fp16 by tolerance, bf16 vs upcast inputs."""
    out, ref = _run(MIXED, dtype)
    assert out.dtype == dtype
    assert rel_err(out, ref) < REL_TOL[dtype]


@pytest.mark.parametrize("window,soft_cap", [(24, None), (40, 3.0)])
def test_sliding_window_and_soft_cap(window, soft_cap):
    out, ref = _run(MIXED, torch.float32, window=window, soft_cap=soft_cap, seed=1)
    assert rel_err(out, ref) < REL_TOL[torch.float32]


def test_odd_group_and_head_dim():
    """3 query heads per KV head and a head_dim that is not a power of two (masked lanes)."""
    requests = [(0, 9), (30, 1), (10, 5)]
    out, ref = _run(requests, torch.float32, heads=6, kv_heads=2, head_dim=24, seed=2)
    assert rel_err(out, ref) < REL_TOL[torch.float32]


def test_rows_past_the_batch_are_untouched():
    q, k_cache, v_cache, table, qsl, seq_lens = make_paged_batch(
        [(3, 2), (0, 1)], 4, 2, 16, BLOCK_SIZE, torch.float32)
    padded = torch.cat([q, torch.zeros_like(q[:2])])  # two padding rows after the 3 tokens
    out = torch.full_like(padded, 7.0)
    paged_attention(padded, k_cache, v_cache, table, qsl, seq_lens, 0.25, max_query_len=2, out=out)
    assert torch.all(out[3:] == 7.0)
    ref = paged_attention_ref(q, k_cache, v_cache, table, qsl, seq_lens, 0.25)
    assert rel_err(out[:3], ref) < 1e-5


def test_launcher_rejects_bad_arguments():
    q, k_cache, v_cache, table, qsl, seq_lens = make_paged_batch([(0, 2)], 4, 2, 16, BLOCK_SIZE,
                                                                 torch.float32)
    with pytest.raises(TypeError, match="int32"):
        paged_attention(q, k_cache, v_cache, table.long(), qsl, seq_lens, 1.0, max_query_len=2)
    with pytest.raises(ValueError, match="head"):
        paged_attention(q[:, :3], k_cache, v_cache, table, qsl, seq_lens, 1.0, max_query_len=2)
    with pytest.raises(TypeError, match="dtypes"):
        paged_attention(q.half(), k_cache, v_cache, table, qsl, seq_lens, 1.0, max_query_len=2)
    assert DEVICE == q.device
