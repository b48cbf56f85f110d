"""apply_grammar_bitmask: xgrammar's kernel on the step's rows equals the plain torch reference,
with rows in any order and a model vocabulary wider than the bitmask (padding masked)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lm_console.engine.sample import grammar_bitmask
from lm_console.engine.sample.grammar_bitmask import apply_grammar_bitmask, apply_grammar_bitmask_reference
from lm_console.kernels import cpu_grammar_bitmask


@pytest.fixture(params=["c-kernel", "xgrammar"])
def kernel(request, monkeypatch):
    if request.param == "xgrammar":
        monkeypatch.setattr(grammar_bitmask.cpu_grammar_bitmask, "supports", lambda logits: False)
    elif cpu_grammar_bitmask.load() is None:
        pytest.skip("no C compiler")
    return request.param


def test_masks_only_the_structured_rows_and_the_padding(kernel) -> None:
    rng = np.random.default_rng(0)
    num_reqs, bitmask_vocab, model_vocab = 6, 1024, 1088  # 32 bitmask words; 64 padding rows
    bitmask = rng.integers(-2**31, 2**31 - 1, size=(3, (bitmask_vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    bitmask[0, :4], bitmask[1, 4:8] = -1, 0  # whole words allowed / refused (the kernel's fast paths)
    logits = torch.randn(num_reqs, model_vocab)
    req_ids = [f"r{i}" for i in range(num_reqs)]
    structured = ["r4", "r0", "r3"]
    got = logits.clone()
    apply_grammar_bitmask(got, bitmask, [req_ids.index(r) for r in structured])
    expected = logits.clone()
    apply_grammar_bitmask_reference(expected, bitmask, [4, 0, 3])
    expected[[4, 0, 3], bitmask_vocab:] = float("-inf")
    assert torch.equal(got, expected)
    assert torch.equal(got[[1, 2, 5]], logits[[1, 2, 5]])  # free rows untouched
    # Bit t of row i allows token t: check a few by hand.
    for row, req in zip(range(3), (4, 0, 3)):
        for token in (0, 31, 32, 999):
            allowed = (int(bitmask[row, token // 32]) >> (token % 32)) & 1
            assert (got[req, token] == logits[req, token]) if allowed else got[req, token] == float("-inf")


def test_a_vocabulary_one_past_a_whole_word_masks_its_last_token(kernel) -> None:
    """1025 tokens: the bitmask's 33rd word holds one bit (token 1024); a row whose grammar
    refuses it gets -inf there, one that allows it keeps the logit."""
    vocab = 1025
    bitmask = np.full((2, (vocab + 31) // 32), -1, dtype=np.int32)
    bitmask[0, 32] = 0  # row 0 refuses token 1024, row 1 allows everything
    logits = torch.randn(2, vocab)
    got = logits.clone()
    apply_grammar_bitmask(got, bitmask, [0, 1])
    assert got[0, 1024] == float("-inf") and torch.equal(got[0, :1024], logits[0, :1024])
    assert torch.equal(got[1], logits[1])
