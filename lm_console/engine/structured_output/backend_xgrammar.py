"""The xgrammar backend: compiles a constraint into a grammar and runs one matcher a request.

xgrammar compiles a JSON schema, regex or EBNF grammar against the tokenizer's vocabulary once
(compiled grammars are cached by the compiler, up to cache_bytes); a GrammarMatcher then tracks one request's
position and fills its row of the token bitmask (bit t of row r: token t is allowed).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


class XgrammarGrammar:
    """One request's matcher over a compiled grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_processed_tokens = 0

    def accept_token(self, token_id: int) -> bool:
        """Advance over one sampled token; False if the grammar does not allow it (state unchanged)."""
        if not 0 <= token_id < self.vocab_size or not self.matcher.accept_token(token_id):
            return False
        self.num_processed_tokens += 1
        return True

    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the request is done."""
        return bool(self.matcher.is_terminated())

    def valid_prefix(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of `token_ids` (speculative drafts) the grammar allows from here,
        ending at a token that completes it; the matcher is left where it was (rollback)."""
        accepted = 0
        for token_id in token_ids:
            if self.matcher.is_terminated() or not 0 <= token_id < self.vocab_size:
                break
            if not self.matcher.accept_token(token_id):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return token_ids[:accepted]

    def fill_rows(self, bitmask: np.ndarray, first_row: int, draft_ids: list[int]) -> int:
        """Fill len(draft_ids) + 1 rows from `first_row`: what the grammar allows next, then after
        each draft in turn (the verification step's rows; the drafts passed valid_prefix). A row
        after a completing draft allows everything: the request ends at that draft, and an
        all-masked row would make its softmax NaN. The matcher is left where it was. Returns the
        next free row."""
        row = first_row
        self.matcher.fill_next_token_bitmask(bitmask, row)
        for token_id in draft_ids:
            row += 1
            accepted = self.matcher.accept_token(token_id)
            assert accepted, "drafts reach the bitmask only after valid_prefix"
            if self.matcher.is_terminated():
                bitmask[row] = -1
            else:
                self.matcher.fill_next_token_bitmask(bitmask, row)
        if draft_ids:
            self.matcher.rollback(len(draft_ids))
        return row + 1


class XgrammarBackend:
    """The tokenizer's vocabulary as xgrammar sees it, and a compiler over it (thread-safe)."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, max_threads: int = 2, cache_bytes: int = 64 << 20) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        # vocab_size is the model's (the logits' width): ids past the tokenizer's vocabulary
        # (padding rows of the embedding) are never allowed.
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # A bounded cache: each distinct constraint adds a compiled grammar, and clients choose them.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=True,
                                            cache_limit_bytes=cache_bytes)
        self._xgr = xgr

    def compile(self, kind: str, spec: str, stop_token_ids: list[int] | None) -> XgrammarGrammar:
        """Compile (kind, spec) from StructuredOutputsParams.grammar_key() and start a matcher.

        Raises whatever xgrammar raises for a constraint it cannot compile (RuntimeError with
        the parser's message); the manager turns it into that request's error.
        """
        compiled = self._compile(kind, spec)
        matcher = self._xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)
        return XgrammarGrammar(matcher, self.vocab_size)

    def _compile(self, kind: str, spec: str) -> Any:
        base, _, mode = kind.partition(":")
        any_whitespace = mode != "compact"
        if base == "json":
            return self.compiler.compile_json_schema(spec, any_whitespace=any_whitespace)
        if base == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if base == "regex":
            return self.compiler.compile_regex(spec)
        if base == "choice":
            return self.compiler.compile_grammar(choice_to_ebnf(json.loads(spec)))
        if base == "grammar":
            return self.compiler.compile_grammar(spec)
        raise ValueError(f"unknown structured output kind {kind!r}")

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        """An int32 bitmask of num_rows rows, ceil(vocab_size / 32) words each."""
        return np.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=np.int32)

    def fill_bitmask(self, grammars: list[XgrammarGrammar], drafts: list[list[int]], bitmask: np.ndarray) -> None:
        """For each grammar in turn, len(drafts[i]) + 1 rows of bitmask: the tokens it allows
        next, then after each of its drafts (one row for a request without drafts)."""
        row = 0
        for grammar, draft_ids in zip(grammars, drafts):
            row = grammar.fill_rows(bitmask, row, draft_ids)


def choice_to_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (each a quoted, escaped literal)."""
    # JSON string escapes (\\", \\\\, \\n, \\uXXXX) are the EBNF literal escapes xgrammar reads.
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
