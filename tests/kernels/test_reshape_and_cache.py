"""reshape_and_cache against its reference: exact copies, slot -1 skipped, strided inputs."""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import DEVICE, ON_GPU
from lm_console.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

NUM_TOKENS, KV_HEADS, HEAD_DIM, NUM_BLOCKS, BLOCK_SIZE = (
    (4096, 8, 128, 1024, 16) if ON_GPU else (9, 2, 24, 6, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_writes_slots_and_skips_padding(dtype):
    heads = 2 * KV_HEADS
    # k and v are strided slices of one fused projection output, as in the model.
    qkv = torch.randn(NUM_TOKENS, (heads + 2 * KV_HEADS) * HEAD_DIM, device=DEVICE).to(dtype)
    key = qkv[:, heads * HEAD_DIM : (heads + KV_HEADS) * HEAD_DIM]
    key = key.view(NUM_TOKENS, KV_HEADS, HEAD_DIM)
    value = qkv[:, (heads + KV_HEADS) * HEAD_DIM :].view(NUM_TOKENS, KV_HEADS, HEAD_DIM)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device=DEVICE)[:NUM_TOKENS]
    slots[1::3] = -1  # PAD_SLOT_ID rows
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    key_cache = torch.full(shape, float("nan"), device=DEVICE).to(dtype)
    value_cache = key_cache.clone()
    key_ref, value_ref = key_cache.clone(), value_cache.clone()
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    reshape_and_cache_ref(key, value, key_ref, value_ref, slots)
    assert torch.equal(key_cache.nan_to_num(-3.0), key_ref.nan_to_num(-3.0))
    assert torch.equal(value_cache.nan_to_num(-3.0), value_ref.nan_to_num(-3.0))
    written = int((~key_cache.isnan()).flatten(2).all(-1).sum())
    assert written == int((slots >= 0).sum())


def test_rejects_mismatched_cache():
    key = torch.zeros(2, KV_HEADS, HEAD_DIM, device=DEVICE)
    cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS + 1, HEAD_DIM, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit"):
        reshape_and_cache(key, key, cache, cache, torch.zeros(2, dtype=torch.long, device=DEVICE))
