"""Split-KV paged attention for decode (flash-decoding): long contexts, few sequences.

With one new token per sequence, the unified kernel runs num_seqs * num_kv_heads programs, each
streaming a whole context: a small batch leaves most of the GPU idle. Here each context is cut
into num_splits chunks attended by separate programs, each writing a partial output and its
log-sum-exp; a second kernel merges the partials. Token i must be request i's only new token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lm_console.kernels.common import check_same_device, is_interpreted, next_pow2, num_sms
from lm_console.kernels.paged_attention import _attend_kv_range, check_paged_inputs, paged_attention_ref

MAX_SPLITS = 16


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------
def split_kv_decode_ref(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    sliding_window: int | None = None, soft_cap: float | None = None,
) -> torch.Tensor:
    """float64 decode attention: q [num_seqs, H, D], one new token per sequence."""
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_ref(q, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                               scale, sliding_window, soft_cap)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["window", "num_splits"])  # one compile for every batch size
def _split_kv_decode_kernel(
    part_out_ptr, part_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr,
    scale, soft_cap, window, num_splits,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0
    if USE_WINDOW:
        first = tl.maximum(seq_len - window, 0)  # the oldest key the new token may see
    chunk = tl.cdiv(tl.cdiv(seq_len - first, num_splits), TILE_N) * TILE_N
    kv_lo = first + split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, seq_len)

    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < GROUP
    head = kv_head * GROUP + offs_m  # [M]
    offs_d = tl.arange(0, HEAD_DIM_P2)
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=mask, other=0.0)  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + seq_len - 1

    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    acc, l_i, m_i = _attend_kv_range(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table_ptr + seq * stride_bt,
        kv_head, kv_lo, kv_hi, scale, soft_cap, window,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        HEAD_DIM, HEAD_DIM_P2, BLOCK_SIZE, TILE_N, USE_WINDOW, USE_SOFT_CAP, UPCAST, IEEE,
    )
    empty = l_i == 0.0  # an empty chunk: weight zero in the merge
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    base = seq.to(tl.int64) * stride_pt + split * stride_ps
    tl.store(part_out_ptr + base + head[:, None] * stride_ph + offs_d[None, :], acc, mask=mask)
    tl.store(part_lse_ptr + seq.to(tl.int64) * stride_lt + head * stride_lh + split, lse,
             mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, num_splits,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    s_ok = offs_s < num_splits
    lse = tl.load(part_lse_ptr + tok * stride_lt + head * stride_lh + offs_s, mask=s_ok,
                  other=float("-inf"))  # [S]
    live = lse > float("-inf")
    m = tl.max(tl.where(live, lse, -1.0e30), 0)
    w = tl.where(live, tl.exp(lse - m), 0.0)  # [S]
    part = tl.load(part_out_ptr + tok * stride_pt + head * stride_ph
                   + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=live[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)  # [S, D]
    total = tl.sum(w, 0)
    o = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)  # [D]
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------
def default_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits that give about four programs per SM (1 = the unified kernel suffices)."""
    target = 4 * num_sms(device.index or 0)
    return max(1, min(MAX_SPLITS, -(-target // max(num_seqs * num_kv_heads, 1))))


def split_kv_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention with each context split across programs; returns out [num_seqs, H, D].

    q: [num_seqs, H, D] (token i is sequence i's new token, its K/V already cached);
    key_cache/value_cache: [num_blocks, block_size, Hkv, D]; block_table: [num_seqs, max_blocks]
    int32; seq_lens: [num_seqs] int32. num_splits defaults to default_num_splits().
    """
    group = check_paged_inputs(q, key_cache, value_cache, block_table, seq_lens)
    num_seqs, num_heads, head_dim = q.shape
    if seq_lens.shape[0] != num_seqs or block_table.shape[0] < num_seqs:
        raise ValueError(f"decode needs one token per sequence: q has {num_seqs} rows, "
                         f"seq_lens {seq_lens.shape[0]}, block_table {block_table.shape[0]}")
    interpreting = is_interpreted(_split_kv_decode_kernel)
    check_same_device(interpreting, q=q, key_cache=key_cache, block_table=block_table,
                      seq_lens=seq_lens)
    out = torch.empty_like(q) if out is None else out
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with a contiguous last axis")
    if num_seqs == 0:
        return out
    num_kv_heads = key_cache.shape[2]
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, q.device)
    if not 1 <= num_splits <= 64:
        raise ValueError(f"num_splits={num_splits} must be in [1, 64]")
    head_dim_p2 = max(16, next_pow2(head_dim))
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim_p2, dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _split_kv_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        part_out, part_lse, q, key_cache, value_cache, block_table, seq_lens,
        scale, soft_cap or 0.0, sliding_window or 0, num_splits,
        q.stride(0), q.stride(1), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim_p2, BLOCK_SIZE=key_cache.shape[1],
        BLOCK_M=max(16, next_pow2(group)), TILE_N=128 if interpreting else 64,
        USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=soft_cap is not None, UPCAST=interpreting,
        IEEE=q.dtype == torch.float32 or interpreting, num_warps=4, num_stages=2,
    )
    _merge_splits_kernel[(num_seqs, num_heads)](
        out, part_out, part_lse, num_splits,
        out.stride(0), out.stride(1), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim_p2, SPLITS_P2=next_pow2(num_splits),
        num_warps=4,
    )
    return out
