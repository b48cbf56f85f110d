"""Structured outputs in the worker: mask the logits rows of grammar-constrained requests.

The engine core's StructuredOutputManager sends one int32 bitmask row per constrained request
(bit t of a row set: token t allowed). Masked tokens get -inf before any sampling stage, so
greedy, random and top-k/top-p sampling all pick an allowed token.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray, req_ids: list[str],
                          req_id_to_row: dict[str, int]) -> None:
    """logits[row of req_ids[i]] keeps only the tokens bitmask[i] allows (in place).

    logits: [num_reqs, vocab] float32. bitmask: [len(req_ids), ceil(bits / 32)] int32, where
    bits may differ from vocab (a padded embedding): tokens past the bitmask are masked too.
    """
    rows = [req_id_to_row[r] for r in req_ids]
    num_reqs, vocab_size = logits.shape
    num_words = (vocab_size + 31) // 32
    full = np.zeros((num_reqs, max(num_words, bitmask.shape[1])), dtype=np.int32)
    full[rows, :bitmask.shape[1]] = bitmask
    _apply(logits, torch.from_numpy(full[:, :num_words]).to(logits.device, non_blocking=True), rows,
           min(vocab_size, bitmask.shape[1] * 32))


def _apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """xgrammar's kernel (a C++ loop on CPU, Triton/CUDA on GPU), then the columns past vocab_size."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)
    if vocab_size < logits.shape[1]:
        index = torch.tensor(rows, device=logits.device)
        logits[index, vocab_size:] = float("-inf")


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
