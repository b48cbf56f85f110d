"""Shared helpers of the kernel tests: device, tolerances, random paged batches."""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# ||out - ref|| / ||ref|| against a float64 reference on the same (rounded) inputs.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error; NaN (an unwritten, poisoned element) never passes."""
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    return float("inf") if err != err else err


def make_paged_batch(requests: list[tuple[int, int]], num_heads: int, num_kv_heads: int,
                     head_dim: int, block_size: int, dtype: torch.dtype, seed: int = 0):
    """Random paged caches (blocks shuffled, stale table tails) and q for (context, query) pairs.

    Returns q [T, H, D], key_cache, value_cache [num_blocks, block_size, Hkv, D], block_table
    [num_seqs, max_blocks] int32, query_start_loc [num_seqs + 1] int32, seq_lens int32.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(c + n) // block_size) for c, n in requests]
    num_blocks = sum(blocks_per_seq) + 3
    perm = (torch.randperm(num_blocks, generator=gen)).tolist()
    table = torch.zeros(len(requests), max(blocks_per_seq) + 2, dtype=torch.int32)
    for i, nb in enumerate(blocks_per_seq):
        table[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
        table[i, nb:] = perm[0]  # stale entries past a row's blocks must never be read as keys
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    num_tokens = sum(n for _, n in requests)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0] + [n for _, n in requests]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([c + n for c, n in requests], dtype=torch.int32)
    return tuple(t.to(DEVICE) for t in (q, key_cache, value_cache, table, qsl, seq_lens))
