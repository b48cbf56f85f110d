"""WordTokenizer: the fake engine's tokenizer (one token a word; ids read back as a fixed word list)."""

from __future__ import annotations

import hashlib

WORDS = ("the", "cache", "block", "token", "page", "batch", "prefix", "model", "step", "queue",
         "memory", "request", "attention", "stream", "engine", "decode", "prefill", "budget")


class WordTokenizer:
    """Encodes each word to a stable id in [0, vocab_size); decodes any id to one of WORDS.

    Lossy on purpose: the fake model has no language, only tokens, and this makes them readable.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """One id per whitespace-separated word (there are no special tokens)."""
        return [int.from_bytes(hashlib.sha256(word.encode()).digest()[:8], "big") % self.vocab_size
                for word in text.split()]

    def word_of(self, token_id: int) -> str:
        return WORDS[token_id % len(WORDS)]

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(self.word_of(t) for t in token_ids)
