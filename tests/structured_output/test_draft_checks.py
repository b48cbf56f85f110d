"""Speculative drafts against a grammar: valid_prefix cuts them at the first refused token, and
fill_rows gives one bitmask row per verification position; both leave the matcher as it was."""

from __future__ import annotations

import numpy as np
from transformers import AutoTokenizer

from lm_console.engine.structured_output.backend_xgrammar import XgrammarBackend


def _allowed(bitmask: np.ndarray, row: int, token_id: int) -> bool:
    return bool((int(bitmask[row, token_id // 32]) >> (token_id % 32)) & 1)


def test_drafts_are_cut_at_the_first_refused_token_and_rows_follow_each_draft(tiny_llama_dir) -> None:  # noqa: ANN001
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(tiny_llama_dir).vocab_size
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    backend = XgrammarBackend(str(tiny_llama_dir), vocab_size)
    grammar = backend.compile("regex", "[0-9]+-x", [tokenizer.eos_token_id])
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    dash, letter = tokenizer.convert_tokens_to_ids("-"), tokenizer.convert_tokens_to_ids("a")
    assert len({*digits, dash, letter}) == 12 and letter != tokenizer.unk_token_id

    before = backend.allocate_bitmask(1)
    grammar.matcher.fill_next_token_bitmask(before, 0)
    assert grammar.valid_prefix([digits[1], digits[2], letter, digits[3]]) == [digits[1], digits[2]]
    assert grammar.valid_prefix([letter]) == [] and grammar.valid_prefix([vocab_size + 5]) == []
    assert grammar.valid_prefix([digits[4], dash]) == [digits[4], dash]
    after = backend.allocate_bitmask(1)
    grammar.matcher.fill_next_token_bitmask(after, 0)
    assert (before == after).all()  # the matcher is where it was

    drafts = [digits[7], dash]
    rows = backend.allocate_bitmask(2 + len(drafts))
    backend.fill_bitmask([grammar, grammar], [[], drafts], rows)
    # Row 0: the first grammar, no drafts. Rows 1-3: the second, before and after each draft.
    assert _allowed(rows, 0, digits[0]) and not _allowed(rows, 0, dash)
    assert _allowed(rows, 1, digits[0]) and not _allowed(rows, 1, dash)
    assert _allowed(rows, 2, dash) and _allowed(rows, 2, digits[0])  # after one digit
    assert not _allowed(rows, 3, dash) and not _allowed(rows, 3, digits[0])  # after "7-": only "x"
    assert grammar.num_processed_tokens == 0 and not grammar.is_terminated()
    assert grammar.accept_token(digits[5])  # the matcher still starts the string
