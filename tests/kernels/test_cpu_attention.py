"""The CPU attention kernels (C, via ctypes: decode and prefill) against float64 references."""

from __future__ import annotations

import pytest
import torch

from lm_console.kernels import cpu_attention

pytestmark = pytest.mark.skipif(cpu_attention.load() is None,
                                reason="no C compiler: the CPU decode kernel is unavailable")


def _reference(q, kv_cache, block_table, seq_lens, token_idx, num_kv_heads, scale, window, soft_cap):
    """float64 attention of each decode row over its blocks' first seq_len positions."""
    _, _, block_size, _, head_dim = kv_cache.shape
    num_heads = q.shape[1] // head_dim
    group = num_heads // num_kv_heads
    out = {}
    for req, seq_len in enumerate(seq_lens.tolist()):
        row = req if token_idx is None else int(token_idx[req])
        num_blocks = -(-seq_len // block_size)
        kv = kv_cache[:, block_table[req, :num_blocks].long()].reshape(2, -1, num_kv_heads, head_dim)
        kv = kv[:, :seq_len].double().repeat_interleave(group, dim=2)  # [2, L, H, D]
        qr = q[row].view(num_heads, head_dim).double()
        scores = torch.einsum("hd,lhd->hl", qr, kv[0]) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        if window is not None:
            scores[:, : max(seq_len - window, 0)] = float("-inf")
        out[row] = torch.einsum("hl,lhd->hd", scores.softmax(-1), kv[1]).reshape(-1)
    return out


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [64, 128, 48], ids=["d64", "d128", "d48-generic"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (20, None), (None, 4.0)],
                         ids=["full", "window", "softcap"])
def test_matches_float64_reference(dtype, atol, head_dim, num_heads, num_kv_heads, window, soft_cap):
    torch.manual_seed(0)
    block_size, num_blocks, num_reqs = 16, 64, 5
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    seq_lens = torch.tensor([1, 15, 16, 17, 90], dtype=torch.int32)  # block edges, ragged
    block_table = torch.randperm(num_blocks - 1)[: num_reqs * 8].add(1).view(num_reqs, 8).to(torch.int32)
    # Decode rows scattered among other tokens, as in a mixed prefill+decode batch.
    token_idx = torch.tensor([6, 0, 3, 7, 2], dtype=torch.long)
    q = torch.randn(9, num_heads * head_dim).to(dtype)
    out = torch.full_like(q, 7.0)
    scale = head_dim ** -0.5
    cpu_attention.paged_decode_attention(q, out, kv_cache, block_table, seq_lens, token_idx,
                                                num_kv_heads, scale, window, soft_cap)
    expected = _reference(q, kv_cache, block_table, seq_lens, token_idx, num_kv_heads, scale,
                          window, soft_cap)
    for row, ref in expected.items():
        torch.testing.assert_close(out[row].double(), ref, atol=atol, rtol=atol)
    untouched = [r for r in range(9) if r not in expected]
    assert bool((out[untouched] == 7.0).all()), "rows that are not decode rows must not be written"


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
def test_every_query_group_size_at_head_dim_64(group):
    """bf16, head_dim 64: groups of 1-6 query heads per kv head keep p.V's accumulators in
    registers (one constant per size), larger groups take the general path; all against float64."""
    torch.manual_seed(group)
    num_kv_heads, block_size, num_blocks = 2, 16, 40
    num_heads = group * num_kv_heads
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, 64).bfloat16()
    seq_lens = torch.tensor([1, 16, 33, 70], dtype=torch.int32)
    block_table = torch.randperm(num_blocks)[:20].view(4, 5).to(torch.int32)
    q = torch.randn(4, num_heads * 64).bfloat16()
    out = torch.empty_like(q)
    for window in (None, 21):
        cpu_attention.paged_decode_attention(q, out, kv_cache, block_table, seq_lens, None, num_kv_heads,
                                             0.125, window)
        expected = _reference(q, kv_cache, block_table, seq_lens, None, num_kv_heads, 0.125, window, None)
        for row, ref in expected.items():
            torch.testing.assert_close(out[row].double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size", [8, 32, 48])
@pytest.mark.parametrize("window", [None, 21])
def test_block_sizes_other_than_the_key_group(block_size, window):
    """The bf16 kernel works on 16-key groups: blocks of 8 (a partial group each), 32 (two) and
    48, with windows that start mid-group, still match float64."""
    torch.manual_seed(1)
    num_heads, num_kv_heads, head_dim, num_blocks = 9, 3, 64, 120
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(torch.bfloat16)
    seq_lens = torch.tensor([1, 7, 16, 33, 150], dtype=torch.int32)
    blocks_per_req = -(-150 // block_size)
    block_table = torch.randperm(num_blocks - 1)[: 5 * blocks_per_req].add(1).view(5, -1).to(torch.int32)
    q = torch.randn(5, num_heads * head_dim).to(torch.bfloat16)
    out = torch.empty_like(q)
    cpu_attention.paged_decode_attention(q, out, kv_cache, block_table, seq_lens, None, num_kv_heads,
                                         head_dim ** -0.5, window)
    expected = _reference(q, kv_cache, block_table, seq_lens, None, num_kv_heads, head_dim ** -0.5,
                          window, None)
    for row, ref in expected.items():
        torch.testing.assert_close(out[row].double(), ref, atol=2e-2, rtol=2e-2)


def test_strided_q_rows_and_in_order_rows():
    """q may be a column slice of a fused qkv output (row stride > H*D); token_idx None."""
    torch.manual_seed(1)
    kv_cache = torch.randn(2, 8, 16, 2, 64)
    qkv = torch.randn(3, (4 + 2 * 2) * 64)
    q = qkv[:, : 4 * 64]
    seq_lens = torch.tensor([5, 33, 20], dtype=torch.int32)
    block_table = torch.tensor([[1, 0, 0], [2, 3, 4], [5, 6, 0]], dtype=torch.int32)
    out = torch.empty(3, 4 * 64)
    cpu_attention.paged_decode_attention(q, out, kv_cache, block_table, seq_lens, None, 2, 0.125)
    expected = _reference(q, kv_cache, block_table, seq_lens, None, 2, 0.125, None, None)
    for row, ref in expected.items():
        torch.testing.assert_close(out[row].double(), ref, atol=2e-6, rtol=2e-6)


def test_bad_arguments_raise_clear_errors():
    kv_cache = torch.randn(2, 4, 16, 1, 64)
    q = torch.randn(1, 64)
    with pytest.raises(TypeError, match="int32"):
        cpu_attention.paged_decode_attention(q, torch.empty_like(q), kv_cache,
                                                    torch.zeros(1, 1, dtype=torch.int64),
                                                    torch.ones(1, dtype=torch.int32), None, 1, 0.1)
    big = torch.randn(2, 4, 16, 1, 512)
    with pytest.raises(ValueError, match="head_dim 512"):
        q = torch.randn(1, 512)
        cpu_attention.paged_decode_attention(q, torch.empty_like(q), big,
                                                    torch.zeros(1, 1, dtype=torch.int32),
                                                    torch.ones(1, dtype=torch.int32), None, 1, 0.1)


@pytest.mark.parametrize("bad", ["past-the-cache", "negative", "row-too-short"])
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_block_table_entries_outside_the_cache_are_refused(kernel, bad):
    """The kernels index the cache with block-table entries: one outside it (or a sequence longer
    than its row) is an IndexError before anything is read or written, not a wild read."""
    kv_cache = torch.randn(2, 4, 16, 1, 64)
    block_table = torch.tensor([[1, 2], [3, 99]], dtype=torch.int32)  # 99: past row 1's one block
    seq_lens = torch.tensor([20, 10], dtype=torch.int32)

    def run(out: torch.Tensor) -> None:
        if kernel == "decode":
            cpu_attention.paged_decode_attention(torch.randn(2, 64), out, kv_cache, block_table, seq_lens,
                                                 None, 1, 0.125)
        else:
            q_lens = torch.tensor([3, 2], dtype=torch.int32)
            cpu_attention.paged_prefill_attention(torch.randn(5, 64), out, kv_cache, block_table,
                                                  torch.tensor([0, 3], dtype=torch.int32), q_lens,
                                                  seq_lens, 1, 0.125)

    rows = 2 if kernel == "decode" else 5
    run(torch.zeros(rows, 64))  # entries a sequence does not reach are never read, so not checked
    if bad == "past-the-cache":
        block_table[0, 1] = 4
    elif bad == "negative":
        block_table[1, 0] = -1
    else:
        seq_lens[0] = 33  # three blocks; the row has two entries
    out = torch.zeros(rows, 64)
    with pytest.raises(IndexError, match="outside the cache's 4 blocks"):
        run(out)
    assert torch.all(out == 0)


def _prefill_reference(q, kv_cache, block_table, q_starts, q_lens, seq_lens, num_kv_heads, scale,
                       window, soft_cap):
    """float64 causal attention of each chunk's queries over its sequence's cached K/V."""
    _, _, block_size, _, head_dim = kv_cache.shape
    num_heads = q.shape[1] // head_dim
    out = {}
    for c in range(len(q_lens)):
        start, length, seq_len = int(q_starts[c]), int(q_lens[c]), int(seq_lens[c])
        num_blocks = -(-seq_len // block_size)
        kv = kv_cache[:, block_table[c, :num_blocks].long()].reshape(2, -1, num_kv_heads, head_dim)
        kv = kv[:, :seq_len].double().repeat_interleave(num_heads // num_kv_heads, dim=2)
        qr = q[start : start + length].view(length, num_heads, head_dim).double()
        scores = torch.einsum("qhd,lhd->hql", qr, kv[0]) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(seq_len - length, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        o = torch.einsum("hql,lhd->qhd", scores.softmax(-1), kv[1]).reshape(length, -1)
        for i in range(length):
            out[start + i] = o[i]
    return out


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
# 64 and 128 have specialized bf16 code; 40 and 72 leave tails (dims not a multiple of 16 or
# 32); an odd head_dim takes the portable path in bf16 too.
@pytest.mark.parametrize("head_dim", [64, 128, 40, 72, 33], ids=["d64", "d128", "d40", "d72", "d33-portable"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (3, 3)], ids=["gqa", "mha"])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (13, None), (None, 4.0), (40, 2.5)],
                         ids=["full", "window", "softcap", "both"])
def test_prefill_matches_float64_reference(dtype, atol, head_dim, num_heads, num_kv_heads, window,
                                           soft_cap):
    torch.manual_seed(0)
    block_size, num_blocks = 16, 96
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    # A whole prompt, a chunk after cached context ending mid-block, a 2-token chunk, and a
    # chunk longer than one query tile starting at a block edge.
    q_lens = torch.tensor([37, 20, 2, 33], dtype=torch.int32)
    seq_lens = torch.tensor([37, 75, 18, 64], dtype=torch.int32)
    q_starts = torch.tensor([0, 37, 57, 59], dtype=torch.int32)
    block_table = torch.randperm(num_blocks - 1)[: 4 * 6].add(1).view(4, 6).to(torch.int32)
    q = torch.randn(int(q_lens.sum()), num_heads * head_dim).to(dtype)
    out = torch.full_like(q, 7.0)
    scale = head_dim ** -0.5
    cpu_attention.paged_prefill_attention(q, out, kv_cache, block_table, q_starts, q_lens, seq_lens,
                                          num_kv_heads, scale, window, soft_cap)
    expected = _prefill_reference(q, kv_cache, block_table, q_starts, q_lens, seq_lens,
                                  num_kv_heads, scale, window, soft_cap)
    assert sorted(expected) == list(range(q.shape[0]))
    for row, ref in expected.items():
        torch.testing.assert_close(out[row].double(), ref, atol=atol, rtol=atol)


def test_prefill_bad_arguments():
    kv_cache = torch.randn(2, 4, 16, 1, 64)
    q = torch.randn(3, 64)
    ones = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="one entry per chunk"):
        cpu_attention.paged_prefill_attention(q, torch.empty_like(q), kv_cache,
                                              torch.zeros(1, 1, dtype=torch.int32), ones,
                                              torch.ones(2, dtype=torch.int32), ones, 1, 0.1)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window,soft_cap,block_size",
                         [(None, None, 16), (150, None, 32), (None, 30.0, 16), (61, 5.0, 32)],
                         ids=["full-bs16", "window-bs32", "softcap-bs16", "both-bs32"])
def test_prefill_long_chunks_match_float64_reference(dtype, atol, window, soft_cap, block_size):
    """Chunks longer than a key segment of the bf16 kernel (128 keys), after cached context:
    several segments per query tile, windows that start mid-segment (query lanes with no key
    in a segment), ragged tails of queries and keys; 9 heads over 3 kv heads, as the
    embedded model."""
    torch.manual_seed(2)
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    q_lens = torch.tensor([300, 131, 1, 258], dtype=torch.int32)
    seq_lens = torch.tensor([300, 331, 77, 389], dtype=torch.int32)  # 0, 200, 76, 131 cached
    q_starts = torch.tensor([0, 300, 431, 432], dtype=torch.int32)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    num_blocks = 4 * max_blocks + 1
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    block_table = torch.randperm(num_blocks - 1)[: 4 * max_blocks].add(1).view(4, max_blocks)
    block_table = block_table.to(torch.int32)
    qkv = torch.randn(int(q_lens.sum()), (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q = qkv[:, : num_heads * head_dim]  # strided rows, as a slice of a fused qkv projection
    out = torch.full_like(q, 7.0)
    scale = head_dim ** -0.5
    cpu_attention.paged_prefill_attention(q, out, kv_cache, block_table, q_starts, q_lens, seq_lens,
                                          num_kv_heads, scale, window, soft_cap)
    expected = _prefill_reference(q, kv_cache, block_table, q_starts, q_lens, seq_lens,
                                  num_kv_heads, scale, window, soft_cap)
    got = out[list(expected)].double()
    torch.testing.assert_close(got, torch.stack(list(expected.values())), atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 7, 3000], ids=["one", "few", "parallel"])
def test_reshape_and_cache_writes_each_row_to_its_slot(dtype, num_tokens):
    num_blocks, block_size, kv_heads, head_dim = 400, 16, 3, 64
    kv_cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    row = kv_heads * head_dim
    qkv = torch.randn(num_tokens, 5 * row).to(dtype)  # key/value are strided views, as in a model
    key, value = qkv[:, 2 * row:3 * row], qkv[:, 4 * row:]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    if num_tokens > 1:
        slots[num_tokens // 2] = -1  # a padding token: skipped
    cpu_attention.reshape_and_cache(key, value, kv_cache, slots)
    flat = kv_cache.view(2, -1, row)
    expected = torch.zeros_like(flat)
    written = slots >= 0
    expected[0, slots[written]] = key[written]
    expected[1, slots[written]] = value[written]
    assert torch.equal(flat, expected)


def test_reshape_and_cache_refuses_a_slot_past_the_cache():
    kv_cache = torch.zeros(2, 4, 16, 1, 8)
    key = torch.ones(2, 8)
    with pytest.raises(IndexError, match="past the cache's 64 slots"):
        cpu_attention.reshape_and_cache(key, key, kv_cache, torch.tensor([3, 64]))
    assert not kv_cache.any()  # nothing written
    with pytest.raises(ValueError, match="int64"):
        cpu_attention.reshape_and_cache(key, key, kv_cache, torch.tensor([3, 4], dtype=torch.int32))
