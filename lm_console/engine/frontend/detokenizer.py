"""IncrementalDetokenizer: generated token ids -> text, step by step, with stop strings.

Seed: OutputProcessor / Detokenizer (lines 4605-4739). Two decoders: the fast one steps a
`tokenizers.decoders.DecodeStream`; the fallback keeps token strings with prefix/read offsets
and re-decodes a short window each step (any tokenizer with convert_ids_to_tokens).
spaces_between_special_tokens is not applied: transformers 5 decode() ignores it as well.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from lm_console.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"  # what an incomplete UTF-8 sequence decodes to
_MIN_PROMPT_CONTEXT = 4  # prompt tokens that prime a decoder, so the first token's text
_MAX_PROMPT_CONTEXT = 24  # (a leading space, a split character) decodes as in context
_OFFSET_WINDOW = 5  # tokens behind the read offset that the fallback re-decodes
_MAX_UTF8_BYTES = 4


class _TokenDecoder(Protocol):
    def decode_next(self, token_id: int) -> str: ...


class IncrementalDetokenizer:
    """Accumulates a request's generated tokens and their text; finds stop strings.

    Invariants: token_ids holds every generated token id, a terminating stop token included;
    output_text is the text of those tokens (never an incomplete character), cut at the first
    stop string found; without a tokenizer it stays "" (token ids only).
    """

    def __init__(self, sampling_params: SamplingParams | None = None,
                 decoder: _TokenDecoder | None = None) -> None:
        params = sampling_params or SamplingParams()
        self.token_ids: list[int] = []
        self._decoder = decoder
        self._text = ""
        self._stop: list[str] = list(params.stop or []) if decoder is not None else []
        self._include_stop_str = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # Held back from streamed text: a partial stop string may still be cut off.
        max_stop_len = max((len(s) for s in self._stop), default=0)
        self._stop_buffer_length = 0 if self._include_stop_str else max(max_stop_len - 1, 0)
        self._last_output_text_offset = 0

    @classmethod
    def from_new_request(cls, tokenizer: Any, prompt_token_ids: list[int] | None,
                         sampling_params: SamplingParams, *,
                         use_fast: bool = True) -> IncrementalDetokenizer:
        """A detokenizer for one request: DecodeStream when the tokenizer allows, else offsets.

        tokenizer None gives a detokenizer that only records token ids; use_fast=False forces
        the offset fallback (tests, or tokenizers whose DecodeStream misbehaves).
        """
        if tokenizer is None:
            return cls(sampling_params)
        prompt_token_ids = list(prompt_token_ids or [])
        skip = sampling_params.skip_special_tokens
        decoder: _TokenDecoder
        if use_fast and _can_stream(tokenizer):
            decoder = _StreamDecoder(tokenizer, prompt_token_ids, skip)
        else:
            context = _prompt_context(tokenizer, prompt_token_ids, skip)
            decoder = _OffsetDecoder(tokenizer, context, skip)
        return cls(sampling_params, decoder)

    @property
    def output_text(self) -> str:
        """All text so far, cut at a matched stop string."""
        return self._text

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far, a terminating stop token included."""
        return len(self.token_ids)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append tokens and their text; return the stop string that ended the output, if any.

        stop_terminated: the last token is an EOS / stop token id; its text is left out unless
        include_stop_str_in_output. On a stop string, output_text is cut at it (keeping it when
        include_stop_str_in_output); the rest of the token that completed it stays in token_ids,
        later tokens of new_token_ids (several arrive at once with speculative decoding) are
        dropped, as if they had arrived one at a time and the first stop had ended the request.
        """
        if not new_token_ids:
            return None
        to_decode = new_token_ids
        if stop_terminated and not self._include_stop_str:
            to_decode = new_token_ids[:-1]
        # Only text after stop_check_offset may complete a stop string: what the first
        # min_tokens - 1 tokens produced cannot end the request.
        stop_check_offset = len(self._text)
        check = bool(self._stop)
        for token_id in to_decode:
            self.token_ids.append(token_id)
            if self._decoder is not None:
                self._text += self._decoder.decode_next(token_id)
            if len(self.token_ids) < self._min_tokens:
                stop_check_offset = len(self._text)
            elif check:
                stop = self._cut_at_stop_string(len(self._text) - stop_check_offset)
                if stop is not None:
                    return stop
                stop_check_offset = len(self._text)
        if len(to_decode) < len(new_token_ids):
            self.token_ids.append(new_token_ids[-1])
        return None

    def _cut_at_stop_string(self, num_new_chars: int) -> str | None:
        """Cut output_text at a stop string ending in the last num_new_chars characters; return it."""
        match = self._find_stop_string(num_new_chars)
        if match is None:
            return None
        stop, index = match
        self._text = self._text[:index + len(stop) if self._include_stop_str else index]
        return stop

    def _find_stop_string(self, num_new_chars: int) -> tuple[str, int] | None:
        """(stop string, start index) of the earliest stop string that ends in the new text.

        A match may start up to len(stop) - 1 characters before the new text (it spans a token
        boundary); ties at one index go to the stop string listed first.
        """
        if num_new_chars <= 0:
            return None
        text = self._text
        best: tuple[str, int] | None = None
        for stop in self._stop:
            start = max(len(text) - num_new_chars - len(stop) + 1, 0)
            index = text.find(stop, start)
            if index != -1 and (best is None or index < best[1]):
                best = (stop, index)
        return best

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """All text so far (delta=False) or only what is new since the last call (delta=True).

        Until finished, the last (longest stop string - 1) characters are held back, so text
        that a stop string could still cut off is never emitted.
        """
        hold = 0 if finished else self._stop_buffer_length
        end = max(len(self._text) - hold, 0)
        if not delta:
            return self._text[:end]
        start = self._last_output_text_offset
        if end <= start:
            return ""
        self._last_output_text_offset = end
        return self._text[start:end]


def _can_stream(tokenizer: Any) -> bool:
    try:
        from tokenizers.decoders import DecodeStream  # noqa: F401
    except ImportError:
        return False
    return bool(getattr(tokenizer, "is_fast", False)) and _backend_of(tokenizer) is not None


def _backend_of(tokenizer: Any) -> Any:
    return getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)


def _prompt_context(tokenizer: Any, prompt_token_ids: list[int], skip: bool) -> list[int]:
    """The shortest prompt tail (>= _MIN_PROMPT_CONTEXT tokens) that starts on a character and
    decodes to some text, before the special tokens that end the prompt where they are skipped.

    Skipped special tokens decode to nothing: a context of only those would leave the first
    generated token to open the decoded text, and a decoder that strips a leading space
    (SentencePiece's) would cut the continuation's first space.
    """
    prompt_token_ids = _without_trailing_skipped(tokenizer, prompt_token_ids, skip)
    num_prompt = len(prompt_token_ids)
    if num_prompt <= _MIN_PROMPT_CONTEXT:
        return list(prompt_token_ids)
    for size in range(_MIN_PROMPT_CONTEXT, min(num_prompt, _MAX_PROMPT_CONTEXT) + 1):
        tail = prompt_token_ids[-size:]
        text = tokenizer.decode(tail, skip_special_tokens=skip)
        if text and not text.startswith(_REPLACEMENT_CHAR):
            return list(tail)
    return list(prompt_token_ids[-_MIN_PROMPT_CONTEXT:])


def _without_trailing_skipped(tokenizer: Any, prompt_token_ids: list[int], skip: bool) -> list[int]:
    """The prompt without the special tokens at its end when decoding skips them (they change
    no decoded text, so the context need not hold them)."""
    if not skip or not prompt_token_ids:
        return prompt_token_ids
    special = set(tokenizer.all_special_ids)
    end = len(prompt_token_ids)
    while end > 0 and prompt_token_ids[end - 1] in special:
        end -= 1
    return prompt_token_ids[:end]


class _StreamDecoder:
    """Steps a DecodeStream primed with the prompt's tail; falls back to offsets if it fails."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip: bool) -> None:
        self._tokenizer = tokenizer
        self._backend = _backend_of(tokenizer)
        self._skip = skip
        self._seen_ids = _prompt_context(tokenizer, prompt_token_ids, skip)
        self._fallback: _OffsetDecoder | None = None
        try:
            self._stream = self._new_stream(self._seen_ids)
        except Exception as exc:  # noqa: BLE001 - any tokenizers failure: use the fallback
            self._switch_to_fallback(exc)

    def _new_stream(self, context: list[int]) -> Any:
        from tokenizers.decoders import DecodeStream

        # Primed by stepping through the context, not DecodeStream(ids=context): a prefilled
        # stream whose context ends inside a character returns the whole context's text with
        # that character once it completes (a prompt ending in an emoji's first byte tokens
        # would repeat its tail in the output). A step returns nothing until a character is whole.
        stream = DecodeStream(skip_special_tokens=self._skip)
        for token_id in context:
            stream.step(self._backend, token_id)
        return stream

    def _switch_to_fallback(self, exc: Exception) -> None:
        logger.warning("DecodeStream failed (%s); using offset detokenization", exc)
        self._fallback = _OffsetDecoder(self._tokenizer, self._seen_ids, self._skip)

    def decode_next(self, token_id: int) -> str:
        if self._fallback is not None:
            return self._fallback.decode_next(token_id)
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception as exc:  # noqa: BLE001 - e.g. "Invalid prefix encountered"
            self._switch_to_fallback(exc)
            assert self._fallback is not None
            return self._fallback.decode_next(token_id)
        self._seen_ids.append(token_id)
        return text or ""


class _OffsetDecoder:
    """Classic incremental detokenization over token strings.

    tokens[prefix_offset:read_offset] is text already emitted, kept as left context; a step
    emits decode(tokens[prefix_offset:]) minus that context, unless it ends in an incomplete
    character (then it waits for more tokens).
    """

    def __init__(self, tokenizer: Any, context_ids: list[int], skip: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_ids: set[int] = set(tokenizer.all_special_ids) if skip else set()
        self._tokens: list[str] = []
        for token_id in context_ids:
            token = self._token_of(token_id)
            if token is not None:
                self._tokens.append(token)
        # Tokens that end the context in an incomplete character were never emitted: leave
        # them after the read offset, so the character comes out whole once completed.
        self._read_offset = len(self._tokens)
        for _ in range(_MAX_UTF8_BYTES):
            window_start = max(self._read_offset - _OFFSET_WINDOW, 0)
            if not self._to_string(window_start, self._read_offset).endswith(_REPLACEMENT_CHAR):
                break
            self._read_offset -= 1
        self._prefix_offset = max(self._read_offset - _OFFSET_WINDOW, 0)
        self._prefix_text = self._to_string(self._prefix_offset, self._read_offset)

    def _token_of(self, token_id: int) -> str | None:
        if token_id in self._skip_ids:
            return None
        return self._tokenizer.convert_ids_to_tokens(token_id)  # None past the vocabulary

    def _to_string(self, start: int, end: int) -> str:
        tokens = self._tokens[start:end]
        return self._tokenizer.convert_tokens_to_string(tokens) if tokens else ""

    def decode_next(self, token_id: int) -> str:
        token = self._token_of(token_id)
        if token is None:
            return ""
        self._tokens.append(token)
        text = self._to_string(self._prefix_offset, len(self._tokens))
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            return ""
        new_text = text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        self._prefix_text = self._to_string(self._prefix_offset, self._read_offset)
        return new_text
