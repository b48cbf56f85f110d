"""Structured outputs in the worker: mask the logits rows of grammar-constrained requests.

The engine core's StructuredOutputManager sends one int32 bitmask row per constrained request
(bit t of a row set: token t allowed). Masked tokens get -inf before any sampling stage, so
greedy, random and top-k/top-p sampling all pick an allowed token.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lm_console.kernels import cpu_grammar_bitmask


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
    """logits[rows[i]] keeps only the tokens bitmask[i] allows (in place).

    logits: [num_rows, vocab] float32. bitmask: [len(rows), ceil(bits / 32)] int32, where
    bits may differ from vocab (a padded embedding): tokens past the bitmask are masked too.
    CPU float32 logits take our C kernel (lm_console/kernels/cpu/grammar_bitmask.c); others xgrammar's.
    """
    if cpu_grammar_bitmask.supports(logits):
        cpu_grammar_bitmask.apply_token_bitmask(logits, torch.from_numpy(np.ascontiguousarray(bitmask)),
                                                torch.tensor(rows, dtype=torch.int64))
        return
    _apply_xgrammar(logits, bitmask, rows)


def _apply_xgrammar(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
    """xgrammar's kernel (Triton/CUDA on GPU), then the columns past the bitmask's width."""
    import xgrammar as xgr

    num_reqs, vocab_size = logits.shape
    num_words = (vocab_size + 31) // 32
    full = np.zeros((num_reqs, max(num_words, bitmask.shape[1])), dtype=np.int32)
    full[rows, :bitmask.shape[1]] = bitmask  # xgrammar indexes the bitmask by logits row
    masked_vocab = min(vocab_size, bitmask.shape[1] * 32)
    xgr.apply_token_bitmask_inplace(logits, torch.from_numpy(full[:, :num_words]).to(logits.device),
                                    vocab_size=masked_vocab, indices=rows)
    if masked_vocab < vocab_size:
        logits[torch.tensor(rows, device=logits.device), masked_vocab:] = float("-inf")


def apply_grammar_bitmask_reference(logits: torch.Tensor, bitmask: Any, rows: list[int]) -> None:
    """The same masking in plain torch (slow): for tests of apply_grammar_bitmask."""
    words = torch.as_tensor(np.asarray(bitmask)).to(torch.int64) & 0xFFFFFFFF  # [R, W]
    shifts = torch.arange(32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [R, W * 32]
    vocab_size = logits.shape[1]
    if allowed.shape[1] < vocab_size:
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], vocab_size - allowed.shape[1])], 1)
    for i, row in enumerate(rows):
        logits[row].masked_fill_(~allowed[i, :vocab_size], float("-inf"))
