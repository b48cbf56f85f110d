"""Deliberately broken engines for the negative controls of the equality tests.

Each equality family (TP, DP, async scheduling, Ray, HF exactness, the scale-out matrix) asserts
that some mode's greedy output equals a reference. A negative control runs the same comparison on
the output of a broken engine and asserts that it FAILS: proof that the assertion, on the tiny
model it uses, would catch that kind of fault.

The faults are monkeypatches of this process, so the broken engines run in-process
(multiprocess=False); a TP=2 fault is emulated on one rank by breaking the heads rank 1 would own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch


@contextmanager
def rank1_attention_zeroed() -> Iterator[None]:
    """Attention output of the heads that rank 1 of TP=2 owns (the second half) set to zero:
    o_proj then sums rank 0's partial output only, as in a TP=2 run whose rank 1 lost its
    attention. Needs the engine in this process (multiprocess=False)."""
    from lm_console.engine.attention.layer import Attention

    real = Attention.forward

    def broken(self: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = real(self, q, k, v).clone()
        out[:, out.shape[1] // 2:] = 0
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Attention, "forward", broken)
        yield


@contextmanager
def block_hash_drops_tokens() -> Iterator[None]:
    """Prefix-cache block hashes that read every 4th token only (12 of 16 ignored)."""
    from lm_console.engine import kv_cache_hashing as hashing

    real = hashing.hash_block_tokens
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hashing, "hash_block_tokens",
                   lambda fn, parent, tokens, extra=None: real(fn, parent, list(tokens)[::4], extra))
        yield
