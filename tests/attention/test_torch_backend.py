"""The torch paged-attention backend against a dense float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from lm_console.engine.attention import Attention, AttentionMetadata, bind_kv_caches, get_kv_cache_shape
from lm_console.engine.attention.sdpa import causal_attention
from lm_console.engine.attention.torch_backend import paged_attention, reshape_and_cache
from lm_console.engine.forward_context import get_forward_context, set_forward_context

BLOCK_SIZE = 16



@pytest.fixture(autouse=True, params=["c-kernel", "torch-gather"])
def decode_path(request, monkeypatch):
    """Every test runs on both decode paths: the C kernel (where it builds) and the gather."""
    from lm_console.kernels import cpu_attention

    if request.param == "torch-gather":
        monkeypatch.setattr(cpu_attention, "supports", lambda q, kv_cache: False)
    elif cpu_attention.load() is None:
        pytest.skip("no C compiler: the CPU decode kernel is unavailable")
    return request.param

def _make_batch(
    requests: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_pad_tokens: int = 0,
    seed: int = 0,
):
    """Random cache, block tables and q/k/v for requests given as (num_context, query_len)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-(c + n) // BLOCK_SIZE) for c, n in requests]
    num_blocks = sum(blocks_per_req) + 5
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 stays unused
    max_blocks = max(blocks_per_req) + 2
    block_table = torch.full((len(requests), max_blocks), -1, dtype=torch.int32)
    tables = []
    for i, nb in enumerate(blocks_per_req):
        ids = [perm.pop() for _ in range(nb)]
        tables.append(ids)
        block_table[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        block_table[i, nb:] = perm[0]  # stale entries past the row's blocks must be ignored
    cache_shape = get_kv_cache_shape(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    kv_cache = torch.randn(cache_shape, generator=gen).to(dtype)

    num_tokens = sum(n for _, n in requests)
    q = torch.randn(num_tokens + num_pad_tokens, num_heads * head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens + num_pad_tokens, num_kv_heads * head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens + num_pad_tokens, num_kv_heads * head_dim, generator=gen).to(dtype)
    slots, qsl, seq_lens = [], [0], []
    for (num_context, query_len), ids in zip(requests, tables):
        for pos in range(num_context, num_context + query_len):
            slots.append(ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        qsl.append(qsl[-1] + query_len)
        seq_lens.append(num_context + query_len)
    slots += [-1] * num_pad_tokens
    md = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=len(requests),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(n for _, n in requests),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        block_size=BLOCK_SIZE,
    )
    return q, k, v, kv_cache, md, tables


def _reference(q, k, v, kv_cache_before, md, tables, num_kv_heads, head_dim, scale,
               window=None, soft_cap=None):
    """Dense per-request attention in float64 over context (from the cache) + new tokens."""
    num_heads = q.shape[1] // head_dim
    out = torch.zeros(md.num_actual_tokens, num_heads * head_dim, dtype=torch.float64)
    for i, ids in enumerate(tables):
        start, end = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        query_len, seq_len = end - start, md.seq_lens_cpu[i]
        num_context = seq_len - query_len
        cached = kv_cache_before[:, ids].reshape(2, -1, num_kv_heads, head_dim)[:, :num_context]
        keys = torch.cat([cached[0], k[start:end].view(-1, num_kv_heads, head_dim)]).double()
        vals = torch.cat([cached[1], v[start:end].view(-1, num_kv_heads, head_dim)]).double()
        group = num_heads // num_kv_heads
        keys = keys.repeat_interleave(group, 1).transpose(0, 1)  # [H, S, D]
        vals = vals.repeat_interleave(group, 1).transpose(0, 1)
        qi = q[start:end].double().view(query_len, num_heads, head_dim).transpose(0, 1)
        scores = qi @ keys.transpose(1, 2) * scale  # [H, T, S]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(num_context, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        o = torch.softmax(scores, -1) @ vals
        out[start:end] = o.transpose(0, 1).reshape(query_len, -1)
    return out


MIXED = [(0, 37), (20, 1), (33, 17), (0, 1), (47, 1), (5, 40), (64, 1), (15, 2)]
# Enough decodes of spread-out lengths to be bucketed into several gather groups.
MANY_DECODES = [(n, 1) for n in (300, 3, 150, 17, 250, 40, 0, 90, 120, 31, 64, 200, 8, 15)]
MANY_DECODES[5:5] = [(0, 9), (70, 4)]


@pytest.mark.parametrize(
    "requests",
    [
        MIXED,
        [(0, 5)],  # one prompt, no context: is_causal fast path
        [(3, 1), (40, 1), (16, 1), (0, 1)],  # pure decode batch
        [(31, 33), (100, 20)],  # prefill chunks over cached context
        MANY_DECODES,
        [(n, 1) for n, _ in MANY_DECODES],
    ],
    ids=["mixed", "single_prefill", "decodes", "chunks", "bucketed_mixed", "bucketed_decodes"],
)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
def test_paged_attention_matches_dense_reference(requests, num_heads, num_kv_heads):
    head_dim = 16
    q, k, v, kv_cache, md, tables = _make_batch(requests, num_heads, num_kv_heads, head_dim,
                                                torch.float32)
    before = kv_cache.clone()
    scale = head_dim**-0.5
    out = paged_attention(q, k, v, kv_cache, md, num_kv_heads, scale)
    ref = _reference(q, k, v, before, md, tables, num_kv_heads, head_dim, scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,soft_cap", [(8, None), (None, 5.0), (24, 3.0)])
@pytest.mark.parametrize("requests", [MIXED, MANY_DECODES], ids=["mixed", "bucketed"])
def test_sliding_window_and_soft_cap(requests, window, soft_cap):
    head_dim = 16
    q, k, v, kv_cache, md, tables = _make_batch(requests, 8, 2, head_dim, torch.float32, seed=3)
    before = kv_cache.clone()
    out = paged_attention(q, k, v, kv_cache, md, 2, 0.3, window, soft_cap)
    ref = _reference(q, k, v, before, md, tables, 2, head_dim, 0.3, window, soft_cap)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_bf16_close_to_reference():
    head_dim = 64
    q, k, v, kv_cache, md, tables = _make_batch(MIXED, 9, 3, head_dim, torch.bfloat16, seed=1)
    before = kv_cache.clone()
    out = paged_attention(q, k, v, kv_cache, md, 3, head_dim**-0.5)
    ref = _reference(q, k, v, before, md, tables, 3, head_dim, head_dim**-0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("requests", [MIXED, MANY_DECODES, [(31, 33), (100, 20)]], ids=["mixed", "bucketed", "chunks"])
def test_int8_cache_matches_reference_over_what_it_holds(requests):
    """kv_cache_dtype="int8": both paths attend over the cache's dequantized values, the new
    tokens' K/V too (as the cache gives them back), and write the same bytes."""
    from lm_console.engine.attention import int8_cache

    head_dim, num_kv_heads = 64, 3
    q, k, v, dense, md, tables = _make_batch(requests, 9, num_kv_heads, head_dim, torch.bfloat16, seed=2)
    rows = dense.view(2, -1, num_kv_heads * head_dim)
    kv_cache = torch.stack([int8_cache.quantize_rows(rows[0], num_kv_heads),
                            int8_cache.quantize_rows(rows[1], num_kv_heads)])
    kv_cache = kv_cache.view(get_kv_cache_shape(dense.shape[1], BLOCK_SIZE, num_kv_heads, head_dim, int8=True))
    before = int8_cache.dequantize(kv_cache, torch.float32)
    out = paged_attention(q, k, v, kv_cache, md, num_kv_heads, head_dim**-0.5)
    ref = _reference(q, int8_cache.round_trip(k, num_kv_heads), int8_cache.round_trip(v, num_kv_heads), before,
                     md, tables, num_kv_heads, head_dim, head_dim**-0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
    slots = md.slot_mapping[: md.num_actual_tokens]
    written = kv_cache.view(2, -1, num_kv_heads, head_dim + 4)[:, slots]
    assert torch.equal(written[0], int8_cache.quantize_rows(k[: md.num_actual_tokens], num_kv_heads))
    assert torch.equal(written[1], int8_cache.quantize_rows(v[: md.num_actual_tokens], num_kv_heads))


def test_padding_tokens_are_not_written_and_output_zero():
    q, k, v, kv_cache, md, tables = _make_batch(MIXED, 4, 2, 16, torch.float32,
                                                num_pad_tokens=3)
    before = kv_cache.clone()
    out = paged_attention(q, k, v, kv_cache, md, 2, 0.25)
    assert out.shape[0] == q.shape[0]
    assert torch.all(out[md.num_actual_tokens :] == 0)
    ref = _reference(q, k, v, before, md, tables, 2, 16, 0.25)
    torch.testing.assert_close(out[: md.num_actual_tokens].double(), ref, atol=1e-5, rtol=1e-5)
    # Only the real tokens' slots changed.
    changed = (kv_cache != before).flatten(3).any(-1).any(0).nonzero()  # [n, 2]
    changed_slots = {b * BLOCK_SIZE + s for b, s in changed.tolist()}
    assert changed_slots == set(md.slot_mapping[: md.num_actual_tokens].tolist())


def test_reshape_and_cache_skips_minus_one():
    kv_cache = torch.zeros(get_kv_cache_shape(4, BLOCK_SIZE, 2, 8))
    key = torch.arange(3 * 16, dtype=torch.float32).view(3, 2, 8) + 1
    value = -key
    slots = torch.tensor([5, -1, 2 * BLOCK_SIZE + 3])
    reshape_and_cache(key, value, kv_cache, slots)
    assert torch.equal(kv_cache[0, 0, 5], key[0])
    assert torch.equal(kv_cache[1, 0, 5], value[0])
    assert torch.equal(kv_cache[0, 2, 3], key[2])
    assert torch.equal(kv_cache[1, 2, 3], value[2])
    assert int((kv_cache != 0).flatten(3).any(-1).sum()) == 4  # 2 slots x (K, V), nothing else


def test_reshape_and_cache_takes_a_strided_slot_mapping():
    kv_cache = torch.zeros(get_kv_cache_shape(4, BLOCK_SIZE, 2, 8))
    key = torch.arange(3 * 16, dtype=torch.float32).view(3, 2, 8) + 1
    slots = torch.tensor([5, 0, 9, 0, 2 * BLOCK_SIZE + 3, 0])[::2]  # a view with stride 2
    reshape_and_cache(key, -key, kv_cache, slots)
    flat = kv_cache.view(2, -1, 2, 8)
    for i, slot in enumerate([5, 9, 2 * BLOCK_SIZE + 3]):
        assert torch.equal(flat[0, slot], key[i]) and torch.equal(flat[1, slot], -key[i])
    assert int((kv_cache != 0).flatten(3).any(-1).sum()) == 6  # 3 slots x (K, V), nothing else


def test_causal_attention_without_cache_matches_reference():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, n * 16, generator=gen) for n in (4, 2, 2))
    out = causal_attention(q, k, v, num_kv_heads=2, scale=0.25)
    md_free = _reference_causal(q, k, v, 2, 16, 0.25)
    torch.testing.assert_close(out.double(), md_free, atol=1e-5, rtol=1e-5)


def _reference_causal(q, k, v, num_kv_heads, head_dim, scale):
    t, num_heads = q.shape[0], q.shape[1] // head_dim
    qh = q.double().view(t, num_heads, head_dim).transpose(0, 1)
    kh = k.double().view(t, num_kv_heads, head_dim).repeat_interleave(2, 1).transpose(0, 1)
    vh = v.double().view(t, num_kv_heads, head_dim).repeat_interleave(2, 1).transpose(0, 1)
    scores = (qh @ kh.transpose(1, 2) * scale).masked_fill(
        torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf
    )
    return (torch.softmax(scores, -1) @ vh).transpose(0, 1).reshape(t, -1)


def test_attention_layer_reads_forward_context():
    layer = Attention(num_heads=8, head_dim=16, scale=0.25, num_kv_heads=2)
    model = torch.nn.Sequential(layer)
    q, k, v, kv_cache, md, tables = _make_batch(MIXED, 8, 2, 16, torch.float32, seed=5)
    before = kv_cache.clone()
    with pytest.raises(RuntimeError, match="forward context"):
        get_forward_context()
    with pytest.raises(RuntimeError, match="bind_kv_caches"), set_forward_context(md):
        layer(q, k, v)
    with pytest.raises(ValueError, match="does not fit"):
        bind_kv_caches(model, [torch.zeros(get_kv_cache_shape(4, 16, 4, 16))])
    bind_kv_caches(model, [kv_cache])
    with set_forward_context(md):
        out = layer(q, k, v)
        out_again = layer(q, k, v)  # second layer of the same step reuses the plan
    ref = _reference(q, k, v, before, md, tables, 2, 16, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_again, out)
    with set_forward_context(None):  # dummy run: one causal sequence, cache untouched
        snapshot = kv_cache.clone()
        layer(q[:6], k[:6], v[:6])
        assert torch.equal(kv_cache, snapshot)
