"""The longest prompt text worth tokenising: a bound that needs no tokenising.

Tokenising costs memory in proportion to the text (a 10 MB prompt peaked at 3.1 GB), so a text
that cannot fit max_model_len tokens is refused before it is tokenised. The bound: a token
stands for at most K characters of the text, K being the length of the longest token string
in the vocabulary (byte-level BPE strings have one character per byte, and a byte is at most
one character; SentencePiece's "▁" is the space it replaces; added tokens are in the vocab).
So a text of more than K * max_model_len characters has more than max_model_len tokens.

That holds only if the tokenizer drops no characters: a normaliser that deletes (Strip,
StripAccents, BERT's clean_text, SentencePiece's precompiled map) or an unknown token that
swallows a whole run (fused <unk>, WordPiece) breaks it. For those tokenizers there is no
safe bound and max_prompt_chars() returns None (the text is tokenised in full, as before).
"""

from __future__ import annotations

import json
from typing import Any

# Normalisers that never shorten the text (Replace is checked: a string for one at least as long).
_KEEPING_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace", "Sequence"}


def max_chars_per_token(tokenizer: Any) -> int | None:
    """K: the most characters of text one token can stand for; None when no such bound holds."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(tokenizer, "get_vocab"):
        return None
    model = backend.model
    if type(model).__name__ != "BPE":
        return None  # WordPiece and Unigram can map a long run of text to one unknown token
    if getattr(model, "unk_token", None) is not None and getattr(model, "fuse_unk", False) \
            and not getattr(model, "byte_fallback", False):
        return None  # a fused <unk> covers any number of unknown characters
    if backend.normalizer is not None and not _keeps_characters(json.loads(backend.normalizer.__getstate__())):
        return None
    try:
        return max((len(token) for token in tokenizer.get_vocab()), default=0) or None
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary
        return None


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int | None:
    """Texts longer than this many characters cannot fit max_model_len tokens (None: no bound)."""
    per_token = max_chars_per_token(tokenizer)
    return None if per_token is None else per_token * max_model_len


def _keeps_characters(spec: dict[str, Any]) -> bool:
    kind = spec.get("type")
    if kind not in _KEEPING_NORMALIZERS:
        return False
    if kind == "Sequence":
        return all(_keeps_characters(child) for child in spec.get("normalizers", ()))
    if kind == "Replace":  # a fixed string replaced by one at least as long ("▁" for " ")
        pattern = (spec.get("pattern") or {}).get("String")
        return isinstance(pattern, str) and len(spec.get("content") or "") >= len(pattern) > 0
    return True
