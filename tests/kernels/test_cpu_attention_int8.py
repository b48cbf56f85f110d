"""The int8 KV cache: its writer (C and torch, the same bytes) and the decode and prefill kernels
reading it, against float64 attention over the dequantized cache."""

from __future__ import annotations

import pytest
import torch

from lm_console.engine.attention import int8_cache
from lm_console.kernels import cpu_attention

from test_cpu_attention import _prefill_reference, _reference

pytestmark = pytest.mark.skipif(cpu_attention.load() is None,
                                reason="no C compiler: the CPU attention kernels are unavailable")
needs_int8_kernels = pytest.mark.skipif(not cpu_attention.supports_int8(64, 9, 3),
                                        reason="no AVX512-BF16: the int8 cache takes the torch path")


def _filled_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """An int8 cache with every slot written from random bf16 rows (keys with a few large dims, as
    rotary keys have)."""
    torch.manual_seed(seed)
    slots = num_blocks * block_size
    key = torch.randn(slots, num_kv_heads * head_dim)
    key[:, ::7] *= 6
    value = torch.randn(slots, num_kv_heads * head_dim)
    cache = torch.zeros(cpu_attention.int8_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), dtype=torch.int8)
    cpu_attention.reshape_and_cache(key.bfloat16(), value.bfloat16(), cache, torch.randperm(slots))
    return cache


@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_writer_stores_the_bytes_of_the_torch_format_and_round_trips_within_half_a_step(head_dim):
    torch.manual_seed(0)
    num_kv_heads, num_tokens = 3, 300
    key = (torch.randn(num_tokens, num_kv_heads * head_dim) * 3).bfloat16()
    value = torch.randn(num_tokens, num_kv_heads * head_dim).bfloat16()
    key[5] = 0  # a zero row: scale 0, values 0
    # values half-way between two steps (a maximum of 127: steps of 1) round to even
    key[6, :head_dim] = 0
    key[6, 0], key[6, 1], key[6, 2], key[6, 3] = 127.0, 63.5, 62.5, -0.5
    cache = torch.zeros(cpu_attention.int8_cache_shape(40, 16, num_kv_heads, head_dim), dtype=torch.int8)
    slots = torch.randperm(640)[:num_tokens]
    slots[7] = -1  # padding: skipped
    cpu_attention.reshape_and_cache(key, value, cache, slots)
    written = slots >= 0
    for side, rows in ((0, key), (1, value)):
        stored = cache[side].view(640, num_kv_heads, -1)[slots[written]]
        assert torch.equal(stored, int8_cache.quantize_rows(rows[written], num_kv_heads))
        back = int8_cache.dequantize(stored, torch.float64).reshape(int(written.sum()), -1)
        exact = rows[written].double().view(-1, num_kv_heads, head_dim)
        step = exact.abs().amax(-1, keepdim=True) / 127
        # half a step, and the float32 product's own rounding
        assert bool(((back.view_as(exact) - exact).abs() <= step * (0.5 + 1e-4)).all())
    row6 = cache[0].view(640, num_kv_heads, -1)[slots[6], 0]
    assert row6[:4].tolist() == [127, 64, 62, 0]
    assert bool((cache[0].view(640, num_kv_heads, -1)[slots[5]] == 0).all())
    untouched = torch.ones(640, dtype=torch.bool)
    untouched[slots[written]] = False
    assert bool((cache.view(2, 640, -1)[:, untouched] == 0).all())


def test_writer_refuses_wrong_rows_and_slots_past_the_cache():
    cache = torch.zeros(cpu_attention.int8_cache_shape(4, 16, 2, 64), dtype=torch.int8)
    rows = torch.randn(3, 128).bfloat16()
    with pytest.raises(ValueError, match="bfloat16 key/value rows for a torch.int8 cache"):
        cpu_attention.reshape_and_cache(rows.float(), rows.float(), cache, torch.arange(3))
    with pytest.raises(IndexError, match="past the cache's 64 slots"):
        cpu_attention.reshape_and_cache(rows, rows, cache, torch.tensor([0, 1, 64]))
    assert bool((cache == 0).all())


@needs_int8_kernels
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (16, 2)], ids=["gqa3", "mha", "gqa8"])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (20, None), (None, 4.0)], ids=["full", "window", "softcap"])
def test_decode_matches_float64_over_the_dequantized_cache(head_dim, num_heads, num_kv_heads, window, soft_cap):
    block_size, num_blocks = 16, 64
    cache = _filled_cache(num_blocks, block_size, num_kv_heads, head_dim, seed=head_dim + num_heads)
    seq_lens = torch.tensor([1, 15, 16, 17, 90], dtype=torch.int32)
    block_table = torch.randperm(num_blocks - 1)[:40].add(1).view(5, 8).to(torch.int32)
    token_idx = torch.tensor([6, 0, 3, 7, 2], dtype=torch.long)
    q = torch.randn(9, num_heads * head_dim).bfloat16()
    out = torch.full_like(q, 7.0)
    scale = head_dim ** -0.5
    cpu_attention.paged_decode_attention(q, out, cache, block_table, seq_lens, token_idx, num_kv_heads,
                                         scale, window, soft_cap)
    dequantized = int8_cache.dequantize(cache, torch.float64)
    expected = _reference(q, dequantized, block_table, seq_lens, token_idx, num_kv_heads, scale, window, soft_cap)
    for row, ref in expected.items():
        torch.testing.assert_close(out[row].double(), ref, atol=2e-2, rtol=2e-2)
    untouched = [r for r in range(9) if r not in expected]
    assert bool((out[untouched] == 7.0).all())


@needs_int8_kernels
@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (13, None), (None, 4.0)], ids=["full", "window", "softcap"])
def test_prefill_matches_float64_over_the_dequantized_cache(head_dim, window, soft_cap):
    block_size, num_blocks, num_heads, num_kv_heads = 16, 48, 6, 2
    cache = _filled_cache(num_blocks, block_size, num_kv_heads, head_dim, seed=head_dim)
    # a whole prompt, a chunk after cached context, a short one crossing a block edge
    q_lens = torch.tensor([40, 23, 5], dtype=torch.int32)
    seq_lens = torch.tensor([40, 100, 18], dtype=torch.int32)
    q_starts = torch.tensor([0, 40, 63], dtype=torch.int32)
    block_table = torch.randperm(num_blocks)[:21].view(3, 7).to(torch.int32)
    q = torch.randn(68, num_heads * head_dim).bfloat16()
    out = torch.zeros_like(q)
    scale = head_dim ** -0.5
    cpu_attention.paged_prefill_attention(q, out, cache, block_table, q_starts, q_lens, seq_lens, num_kv_heads,
                                          scale, window, soft_cap)
    # The kernel rounds the dequantized K/V to bf16 as it repacks them.
    dequantized = int8_cache.dequantize(cache, torch.bfloat16)
    expected = _prefill_reference(q, dequantized, block_table, q_starts, q_lens, seq_lens, num_kv_heads, scale,
                                  window, soft_cap)
    for row, ref in expected.items():
        torch.testing.assert_close(out[row].double(), ref, atol=2e-2, rtol=2e-2)


def test_unsupported_shapes_are_refused_and_left_to_the_torch_path():
    cache = torch.zeros(cpu_attention.int8_cache_shape(4, 16, 2, 48), dtype=torch.int8)
    q = torch.randn(1, 4 * 48).bfloat16()
    assert not cpu_attention.supports_int8(48, 4, 2)
    assert not cpu_attention.supports_int8(64, 34, 2)  # a group of 17 (at most 16)
    assert not cpu_attention.supports_int8(64, 65, 65)  # more than 64 query heads
    assert not cpu_attention.supports_int8(64, 4, 2, block_size=128)
    assert not cpu_attention.supports(q, cache)
    with pytest.raises(ValueError, match="unsupported shape"):
        cpu_attention.paged_decode_attention(q, torch.empty_like(q), cache, torch.zeros(1, 1, dtype=torch.int32),
                                             torch.ones(1, dtype=torch.int32), None, 2, 0.1)
    with pytest.raises(TypeError, match="int8 KV cache takes bf16 queries"):
        cpu_attention.paged_decode_attention(q.float(), torch.empty_like(q.float()), cache,
                                             torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                             None, 2, 0.1)
