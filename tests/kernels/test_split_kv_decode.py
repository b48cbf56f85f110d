"""Split-KV (flash-decoding) paged attention against its float64 reference."""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import ON_GPU, REL_TOL, make_paged_batch, rel_err
from lm_console.kernels.split_kv_decode import default_num_splits, split_kv_decode, split_kv_decode_ref

if ON_GPU:  # long-context decode: few sequences, contexts to 32k, 32/8 heads of 128
    HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
    CONTEXTS = [32767, 8000, 1, 20000, 515]
else:
    HEADS, KV_HEADS, HEAD_DIM = 8, 2, 32
    CONTEXTS = [300, 3, 130, 17]


@pytest.mark.parametrize("dtype,window,num_splits", [
    (torch.float32, None, 3),
    (torch.bfloat16, None, None),
    (torch.float16, 100, 4),
])
def test_split_kv_decode_matches_reference(dtype, window, num_splits):
    requests = [(n - 1, 1) for n in CONTEXTS]
    q, k_cache, v_cache, table, _, seq_lens = make_paged_batch(
        requests, HEADS, KV_HEADS, HEAD_DIM, 16, dtype, seed=3)
    out = torch.full_like(q, float("nan"))
    split_kv_decode(q, k_cache, v_cache, table, seq_lens, HEAD_DIM**-0.5, sliding_window=window,
                    num_splits=num_splits, out=out)
    ref = split_kv_decode_ref(q, k_cache, v_cache, table, seq_lens, HEAD_DIM**-0.5, window)
    assert rel_err(out, ref) < REL_TOL[dtype]


def test_default_num_splits_fills_the_device():
    device = torch.device("cuda" if ON_GPU else "cpu")
    assert default_num_splits(1, 8, device) > 1
    assert default_num_splits(4096, 8, device) == 1
