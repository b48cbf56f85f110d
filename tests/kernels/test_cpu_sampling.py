"""The C sampling kernels (lm_console/kernels/cpu/sampling.c): the exponential race against its scalar reference
and the law, the argmax against torch.argmax."""

from __future__ import annotations

import pytest
import torch

from lm_console.kernels import cpu_sampling

pytestmark = pytest.mark.skipif(cpu_sampling.load() is None,
                                reason="no C compiler: the CPU sampling kernel is unavailable")


def _keys(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(-2**63, 2**63 - 1, (n,), dtype=torch.int64,
                         generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("vocab", [5, 16, 1000, 49155])
def test_vector_path_equals_scalar_reference(vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(24, vocab) * 4
    logits[:, ::7] = float("-inf")  # filtered tokens, also in the non-multiple-of-16 tail
    logits[:, 1] = 0.0  # every row keeps a finite token
    keys = _keys(24)
    fast = cpu_sampling.exponential_race(logits, keys)
    slow = cpu_sampling.exponential_race(logits, keys, vectorized=False)
    assert torch.equal(fast, slow)
    assert not bool((fast % 7 == 0).any()), "a -inf token was sampled"


def test_frequencies_follow_the_softmax():
    """20k keys on one row: each token's frequency within 4 standard errors of softmax."""
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, float("-inf"), 3.0] * 5)  # 35 tokens
    rows = 20000
    tokens = cpu_sampling.exponential_race(logits.repeat(rows, 1).contiguous(), _keys(rows, 1))
    freq = torch.bincount(tokens, minlength=logits.numel()).double() / rows
    probs = logits.double().softmax(0)
    stderr = (probs * (1 - probs) / rows).sqrt()
    assert bool(((freq - probs).abs() <= 4 * stderr + 1e-12).all()), (freq, probs)


def test_noise_is_uncorrelated_between_neighbouring_keys():
    """Keys k and k+1 (consecutive seeds' draws are not, but a weak hash would show it here)
    must pick the same token no more often than chance on a flat row."""
    vocab, rows = 64, 4000
    base = torch.randint(0, 2**40, (rows,), dtype=torch.int64, generator=torch.Generator().manual_seed(2))
    flat = torch.zeros(rows, vocab)
    a = cpu_sampling.exponential_race(flat, base)
    b = cpu_sampling.exponential_race(flat, base + 1)
    same = float((a == b).double().mean())
    assert same < 1 / vocab + 0.01, same
    assert len(set(a.tolist())) == vocab  # every token reachable


def test_same_key_same_token_and_bad_arguments():
    logits = torch.randn(3, 100)
    keys = _keys(3)
    assert torch.equal(cpu_sampling.exponential_race(logits, keys), cpu_sampling.exponential_race(logits, keys))
    with pytest.raises(ValueError, match="float32"):
        cpu_sampling.exponential_race(logits.double(), keys)
    with pytest.raises(ValueError, match="keys"):
        cpu_sampling.exponential_race(logits, keys[:2])
    with pytest.raises(ValueError, match="contiguous along V"):
        cpu_sampling.exponential_race(logits.t(), _keys(100))


@pytest.mark.parametrize("vectorized", [True, False], ids=["avx512", "scalar"])
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1000, 49152])
def test_argmax_is_torchs(vocab, vectorized):
    """Greedy rows: the first maximum, as torch.argmax; ties, infinities and NaN included."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab + 3, generator=g)[:, :vocab]  # a row stride wider than V
    logits[1] = float("-inf")  # all -inf: index 0
    logits[2, vocab // 2:] = 7.0  # a tie: the first of them
    logits[3, -1] = float("inf")
    logits[4, vocab // 3] = float("nan")  # NaN ranks above everything: its index
    logits[5, :] = float("nan")
    logits[6, vocab - 1] = 50.0  # in the tail the vector loop leaves
    logits[7] = torch.round(logits[7])  # many ties
    got = cpu_sampling.argmax(logits, vectorized=vectorized)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1))


def test_argmax_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="float32"):
        cpu_sampling.argmax(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous along V"):
        cpu_sampling.argmax(torch.zeros(8, 2).t())
    with pytest.raises(ValueError, match="V > 0"):
        cpu_sampling.argmax(torch.zeros(2, 0))
