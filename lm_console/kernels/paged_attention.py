"""Paged attention over the block table: one kernel for a mixed batch of prefills and decodes.

Request i owns the query rows q[query_start_loc[i]:query_start_loc[i+1]]: the last query_len
tokens of a sequence of seq_lens[i] tokens whose K/V are all in the paged cache already (the
caller runs reshape_and_cache first). A new token attends to every cached token before it and
causally to the new tokens, optionally within a sliding window and with a tanh logit soft cap.

One program owns BLOCK_Q query tokens of one request times the GROUP query heads that share one
KV head (grouped-query attention), i.e. BLOCK_M = BLOCK_Q * GROUP rows, and streams the request's
K/V in tiles of TILE_N tokens (flash-attention online softmax). Tiles gather their physical
blocks through the block table, so a tile need not match the cache's block size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lm_console.kernels.common import check_float, check_same_device, is_interpreted, next_pow2


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------
def paged_attention_ref(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Dense float64 attention per request: q [T, H, D] -> [T, H, D] float64.

    key_cache/value_cache: [num_blocks, block_size, Hkv, D]; block_table: [num_seqs, max_blocks].
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        blocks = block_table[i, : -(-seq_len // block_size)].long()
        keys = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].double()
        vals = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].double()
        keys = keys.repeat_interleave(group, 1).transpose(0, 1)  # [H, S, D]
        vals = vals.repeat_interleave(group, 1).transpose(0, 1)
        qi = q[start:end].double().transpose(0, 1)  # [H, Tq, D]
        scores = qi @ keys.transpose(1, 2) * scale  # [H, Tq, S]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[start:end] = (torch.softmax(scores, -1) @ vals).transpose(0, 1)
    return out


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _tanh(x):
    """tanh from exp (no libdevice, so it also runs under the interpreter); saturates cleanly."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _attend_kv_range(
    acc, l_i, m_i, q, q_pos,  # running state [M, D], [M], [M]; q [M, D]; q_pos [M]
    k_cache_ptr, v_cache_ptr, table_row_ptr,
    kv_head, kv_lo, kv_hi, scale, soft_cap, window,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Online-softmax attention of q's rows over the cached tokens [kv_lo, kv_hi)."""
    offs_d = tl.arange(0, HEAD_DIM_P2)
    d_ok = offs_d < HEAD_DIM
    for tile_start in range((kv_lo // TILE_N) * TILE_N, kv_hi, TILE_N):
        offs_n = tile_start + tl.arange(0, TILE_N)  # [N] token positions
        n_ok = (offs_n >= kv_lo) & (offs_n < kv_hi)
        block = tl.load(table_row_ptr + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh  # [N]
        v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
        k = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None],
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [D, N]
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [N, D]
        if UPCAST:  # the interpreter computes wrong bf16 dots / elementwise ops: go fp32 now
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")  # [M, N]
        else:
            s = tl.dot(q, k)
        s = s * scale
        if USE_SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        allowed = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])  # [M, N]
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The request whose query blocks hold global block q_block (binary search).

    Request i's blocks start at query_start_loc[i] // BLOCK_Q + i: strictly increasing, and at
    least cdiv(query_len_i, BLOCK_Q) apart.
    """
    lo: tl.int32 = 0  # annotated: a tensor from the start, so the loop carries one type
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["window", "num_seqs"])  # batch-dependent: one compile for all
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale, soft_cap, window, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= query_len:
        return  # a spare program of the over-sized grid
    seq_len = tl.load(seq_lens_ptr + seq)
    num_context = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = local_block * BLOCK_Q + offs_m // GROUP  # [M] new-token index within the request
    head = kv_head * GROUP + offs_m % GROUP  # [M] query head
    row_ok = (offs_m // GROUP < BLOCK_Q) & (q_idx < query_len)
    q_pos = num_context + q_idx  # [M] absolute position
    offs_d = tl.arange(0, HEAD_DIM_P2)
    d_ok = offs_d < HEAD_DIM
    tok = (q_start + q_idx).to(tl.int64)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)

    last_q = tl.minimum(local_block * BLOCK_Q + BLOCK_Q, query_len) - 1
    kv_hi = num_context + last_q + 1  # the block's last query sees keys up to itself
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(num_context + local_block * BLOCK_Q - window + 1, 0)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: no inf - inf in the rescale
    acc, l_i, m_i = _attend_kv_range(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table_ptr + seq * stride_bt,
        kv_head, kv_lo, kv_hi, scale, soft_cap, window,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        HEAD_DIM, HEAD_DIM_P2, BLOCK_SIZE, TILE_N, USE_WINDOW, USE_SOFT_CAP, UPCAST, IEEE,
    )
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=q_mask)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------
def check_paged_inputs(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_table: torch.Tensor, seq_lens: torch.Tensor) -> int:
    """Validate the common paged-attention arguments; returns GROUP (query heads per KV head)."""
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_float(name, t)
    if q.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"want q [T, H, D] and caches [num_blocks, block_size, Hkv, D]; got "
                         f"{tuple(q.shape)}, {tuple(key_cache.shape)}, {tuple(value_cache.shape)}")
    if q.shape[2] != key_cache.shape[3] or q.shape[1] % key_cache.shape[2]:
        raise ValueError(f"head_dim or head counts of q {tuple(q.shape)} do not fit the cache "
                         f"{tuple(key_cache.shape)}")
    if not (q.dtype == key_cache.dtype == value_cache.dtype):
        raise TypeError(f"q, key_cache, value_cache dtypes differ: {q.dtype}, {key_cache.dtype}, "
                        f"{value_cache.dtype}")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise TypeError("block_table and seq_lens must be int32")
    if block_table.dim() != 2 or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be [num_seqs, max_blocks] with contiguous rows, "
                         f"got shape {tuple(block_table.shape)} strides {block_table.stride()}")
    block_size = key_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"the cache's block_size {block_size} must be a power of two")
    return q.shape[1] // key_cache.shape[2]


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each request's new tokens over its paged K/V; returns out [T, H, D].

    q: [T, H, D]; key_cache/value_cache: [num_blocks, block_size, Hkv, D]; block_table:
    [num_seqs, max_blocks] int32; query_start_loc: [num_seqs + 1] int32; seq_lens: [num_seqs]
    int32. max_query_len only picks the tile shape (an upper bound is fine). Rows of q past
    query_start_loc[-1] are left untouched in `out`.
    """
    group = check_paged_inputs(q, key_cache, value_cache, block_table, seq_lens)
    if query_start_loc.dtype != torch.int32 or query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError("query_start_loc must be int32 [num_seqs + 1]")
    interpreting = is_interpreted(_paged_attention_kernel)
    check_same_device(interpreting, q=q, key_cache=key_cache, block_table=block_table,
                      seq_lens=seq_lens, query_start_loc=query_start_loc)
    out = torch.empty_like(q) if out is None else out
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with a contiguous last axis")
    num_tokens, num_kv_heads, head_dim = q.shape[0], key_cache.shape[2], q.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out

    rows = max(max_query_len, 1) * group
    block_m = max(16, next_pow2(group), 16 if rows <= 16 else (64 if rows <= 64 else 128))
    tile_n, num_warps, num_stages = 64, 4, 2
    if interpreting:
        tile_n = 128  # fewer, larger numpy steps
    elif block_m == 128:
        num_warps, num_stages = 8, 2
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, q, key_cache, value_cache, block_table, query_start_loc, seq_lens,
        scale, soft_cap or 0.0, sliding_window or 0, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P2=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=key_cache.shape[1], BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=soft_cap is not None,
        UPCAST=interpreting, IEEE=q.dtype == torch.float32 or interpreting,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
