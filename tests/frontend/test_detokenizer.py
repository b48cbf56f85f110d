"""IncrementalDetokenizer: incremental text, stop strings, delta streaming, special tokens."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lm_console.engine.frontend.detokenizer import IncrementalDetokenizer
from lm_console.engine.sampling_params import SamplingParams

PIECES = ["the", " cat", " sat", ".", "\n", "  ", "é", "ü", "ß", "日本語", "中文", "한국어",
          "🎉", "👍🏽", "👩‍👩‍👧", "🤖", "€", "Ω", "—", "x", "STOP", "?!"]
text_strategy = st.lists(
    st.one_of(st.sampled_from(PIECES),
              st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd")),
    min_size=1, max_size=25,
).map("".join)
_settings = settings(max_examples=40, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


def _feed(detok: IncrementalDetokenizer, token_ids: list[int], chunk_sizes: list[int]
          ) -> list[str]:
    """Feed token_ids in chunks (sizes cycled); return output_text after each update."""
    texts, start, i = [], 0, 0
    while start < len(token_ids):
        size = chunk_sizes[i % len(chunk_sizes)] if chunk_sizes else 1
        detok.update(token_ids[start:start + size], False)
        texts.append(detok.output_text)
        start, i = start + size, i + 1
    return texts


def _expected(tokenizer: Any, prompt_ids: list[int], ids: list[int], skip: bool = True) -> str:
    """The continuation's text as decoding prompt and continuation together gives it."""
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=skip)
    full_text = tokenizer.decode(prompt_ids + ids, skip_special_tokens=skip)
    assert full_text.startswith(prompt_text)
    return full_text[len(prompt_text):]


@pytest.mark.parametrize("use_fast", [True, False])
@_settings
@given(text=text_strategy, prompt=st.sampled_from(["", "Once upon a time, ", "日本"]),
       chunk_sizes=st.lists(st.integers(1, 3), max_size=4))
def test_incremental_text_equals_decode(smollm2_tokenizer: Any, use_fast: bool, text: str,
                                        prompt: str,
                                        chunk_sizes: list[int]) -> None:
    tok = smollm2_tokenizer
    prompt_ids = tok.encode(prompt) if prompt else []
    ids = tok.encode(text)
    assume(tok.decode(ids) == text)  # a few rare code points do not survive the vocab
    detok = IncrementalDetokenizer.from_new_request(tok, prompt_ids, SamplingParams(),
                                                    use_fast=use_fast)
    texts = _feed(detok, ids, chunk_sizes)
    assert detok.output_text == tok.decode(ids) == _expected(tok, prompt_ids, ids)
    assert detok.token_ids == ids
    assert all("\ufffd" not in t for t in texts)  # never a split character


@pytest.mark.parametrize("use_fast", [True, False])
@_settings
@given(text=text_strategy, prompt=st.sampled_from(["", "the cat", "日本 the"]))
def test_byte_fallback_tokenizer(byte_fallback_tokenizer: Any, use_fast: bool, text: str,
                                 prompt: str) -> None:
    tok = byte_fallback_tokenizer
    prompt_ids = tok.encode(prompt, add_special_tokens=False) if prompt else []
    ids = tok.encode(text, add_special_tokens=False)
    assume("<unk>" not in tok.convert_ids_to_tokens(ids))
    detok = IncrementalDetokenizer.from_new_request(tok, prompt_ids, SamplingParams(),
                                                    use_fast=use_fast)
    texts = _feed(detok, ids, [1])
    assert detok.output_text == _expected(tok, prompt_ids, ids)
    if not prompt:
        assert detok.output_text == tok.decode(ids)
    assert all("\ufffd" not in t for t in texts)


def test_byte_fallback_bytes_wait_for_the_whole_character(byte_fallback_tokenizer: Any) -> None:
    tok = byte_fallback_tokenizer
    ids = tok.encode("a🎉", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids)[-4:] == ["<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"]
    detok = IncrementalDetokenizer.from_new_request(tok, [], SamplingParams())
    assert _feed(detok, ids, [1])[-4:] == ["a", "a", "a", "a🎉"]


def test_emoji_split_across_byte_level_tokens(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode(" 🎉")
    assert len(ids) > 1  # the emoji's bytes span several tokens
    for use_fast in (True, False):
        detok = IncrementalDetokenizer.from_new_request(tok, tok.encode("Hi"),
                                                        SamplingParams(), use_fast=use_fast)
        texts = _feed(detok, ids, [1])
        assert texts[:-1] == [""] * (len(ids) - 1) and texts[-1] == " 🎉"


# -- stop strings --------------------------------------------------------------------------

TEXT = " The quick brown fox jumps over the lazy dog. The end."


def _boundary_stop(tokenizer: Any, ids: list[int], token_index: int) -> str:
    """A stop string made of the end of token token_index-1 and the start of token_index."""
    boundary = len(tokenizer.decode(ids[:token_index]))
    return tokenizer.decode(ids)[boundary - 2:boundary + 2]


@pytest.mark.parametrize("use_fast", [True, False])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(smollm2_tokenizer: Any, use_fast: bool, include: bool) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode(TEXT)
    stop = _boundary_stop(tok, ids, 4)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer.from_new_request(tok, [], params, use_fast=use_fast)
    results = [detok.update([token_id], False) for token_id in ids[:5]]
    assert results == [None] * 4 + [stop]  # found by the token that completes it
    index = TEXT.index(stop)
    assert detok.output_text == TEXT[:index + len(stop) if include else index]
    assert detok.get_next_output_text(finished=True, delta=False) == detok.output_text


def test_earliest_of_several_stop_strings_wins(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode(TEXT)
    params = SamplingParams(stop=["lazy", "zzz", "brown f", "quick"])
    detok = IncrementalDetokenizer.from_new_request(tok, [], params)
    assert detok.update(ids, False) == "quick"  # all tokens in one update
    assert detok.output_text == " The "
    params = SamplingParams(stop=["over the", "over"], include_stop_str_in_output=True)
    # Tokens arriving together (speculative decoding) stop where they would one at a time:
    # "over" is complete a token before "over the", and the tokens after it are dropped.
    for updates in ([ids], [[t] for t in ids]):
        detok = IncrementalDetokenizer.from_new_request(tok, [], params)
        stops = [None]
        for update in updates:
            stops.append(detok.update(update, False))
            if stops[-1] is not None:
                break  # the request ends at its first stop
        assert stops[-1] == "over"
        assert detok.output_text == TEXT[:TEXT.index("over") + len("over")]
        assert tok.decode(detok.token_ids).endswith("over")


@pytest.mark.parametrize("use_fast", [True, False])
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("delta", [True, False])
def test_streaming_never_emits_a_partial_stop_string(smollm2_tokenizer: Any, use_fast: bool,
                                                     include: bool, delta: bool) -> None:
    tok = smollm2_tokenizer
    text = " go STO and STOP then STOP! and more text"
    ids = tok.encode(text)
    params = SamplingParams(stop=["STOP!", "zzzzzz"], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer.from_new_request(tok, [], params, use_fast=use_fast)
    emitted, stop = [], None
    for token_id in ids:
        stop = detok.update([token_id], False)
        finished = stop is not None
        emitted.append(detok.get_next_output_text(finished, delta))
        if finished:
            break
    final = " go STO and STOP then " + ("STOP!" if include else "")
    assert stop == "STOP!" and detok.output_text == final
    streamed = "" if delta else emitted[-1]
    for chunk in emitted:
        streamed = streamed + chunk if delta else chunk
        assert final.startswith(streamed if delta else chunk)
    assert streamed == final


def test_min_tokens_defers_stop_strings(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode(" a b a b a b")
    assert len(ids) == 6
    params = SamplingParams(stop=["a"], min_tokens=3)
    detok = IncrementalDetokenizer.from_new_request(tok, [], params)
    assert [detok.update([t], False) for t in ids[:3]] == [None, None, "a"]
    assert detok.output_text == " a b "
    detok = IncrementalDetokenizer.from_new_request(tok, [], params)
    assert detok.update(ids, False) == "a" and detok.output_text == " a b "


# -- stop tokens and special tokens --------------------------------------------------------

@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_excluded_unless_included(smollm2_tokenizer: Any, include: bool) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode(" hello world")
    period = tok.encode(".")[0]
    params = SamplingParams(stop_token_ids=[period], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer.from_new_request(tok, [], params)
    detok.update(ids, False)
    assert detok.update([period], True) is None
    assert detok.output_text == " hello world" + ("." if include else "")
    assert detok.token_ids == ids + [period]
    eos = tok.eos_token_id
    detok = IncrementalDetokenizer.from_new_request(tok, [], SamplingParams(
        include_stop_str_in_output=include))
    detok.update(ids + [eos], True)  # EOS: special, skipped either way
    assert detok.output_text == " hello world"


@pytest.mark.parametrize("use_fast", [True, False])
@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(smollm2_tokenizer: Any, use_fast: bool, skip: bool) -> None:
    tok = smollm2_tokenizer
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = [im_start] + tok.encode("assistant\nHi 🎉") + [im_end] + tok.encode(" there")
    prompt = [im_start] + tok.encode("user\nhello") + [im_end]
    params = SamplingParams(skip_special_tokens=skip)
    detok = IncrementalDetokenizer.from_new_request(tok, prompt, params, use_fast=use_fast)
    _feed(detok, ids, [1])
    assert detok.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.output_text) is not skip


def test_without_tokenizer_only_token_ids_are_kept() -> None:
    detok = IncrementalDetokenizer.from_new_request(None, [1, 2], SamplingParams(stop=["x"]))
    assert detok.update([5, 6], False) is None
    assert detok.token_ids == [5, 6] and detok.output_text == ""
    assert detok.get_next_output_text(finished=False, delta=True) == ""


def test_out_of_vocabulary_ids_are_ignored(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode(" hi there")
    for use_fast in (True, False):
        detok = IncrementalDetokenizer.from_new_request(tok, [], SamplingParams(),
                                                        use_fast=use_fast)
        detok.update(ids[:1] + [len(tok) + 100] + ids[1:], False)
        assert detok.output_text == " hi there"


def test_falls_back_when_the_decode_stream_fails(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    class FailingStream:
        def step(self, backend: Any, token_id: int) -> str | None:
            raise RuntimeError("Invalid prefix encountered")

    ids = tok.encode(" one two 🎉 three")
    detok = IncrementalDetokenizer.from_new_request(tok, tok.encode("Count:"),
                                                    SamplingParams())
    detok.update(ids[:3], False)
    detok._decoder._stream = FailingStream()  # type: ignore[union-attr]
    detok.update(ids[3:], False)
    assert detok.output_text == tok.decode(ids)


class _PieceDecoder:
    """Token id i decodes to pieces[i] (no tokenizer: the stop and streaming logic alone)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode_next(self, token_id: int) -> str:
        return self.pieces[token_id]


def test_deltas_never_repeat_text_when_a_stop_string_cuts_below_what_was_streamed() -> None:
    """"abcST" streams "ab" (3 characters held back for "STOP"); "OP" then completes the stop
    string and cuts the text to "abc", below the end of what the held-back window allowed: a
    delta asked for before the caller sees the stop is empty, and the deltas add up to "abc"."""
    detok = IncrementalDetokenizer(SamplingParams(stop=["STOP"]), _PieceDecoder(["abcST", "OP"]))
    assert detok.update([0], False) is None
    deltas = [detok.get_next_output_text(False, True)]
    assert deltas == ["ab"]
    assert detok.update([1], False) == "STOP" and detok.output_text == "abc"
    deltas.append(detok.get_next_output_text(False, True))
    deltas.append(detok.get_next_output_text(True, True))
    assert deltas == ["ab", "", "c"]


def test_a_stop_string_inside_the_first_min_tokens_text_never_ends_the_request() -> None:
    """min_tokens=3: "STOP" in the first token's text may not end the request, however long the
    text after it; only a stop string that ends past the first min_tokens - 1 tokens' text can."""
    params = SamplingParams(stop=["STOP"], min_tokens=3)
    detok = IncrementalDetokenizer(params, _PieceDecoder(["STOP", "x", "y", "STO", "P"]))
    assert [detok.update([t], False) for t in range(5)] == [None, None, None, None, "STOP"]
    assert detok.output_text == "STOPxy"


@pytest.mark.parametrize("use_fast", [True, False])
def test_a_prompt_ending_inside_a_character_gets_it_whole_from_the_continuation(
        byte_fallback_tokenizer: Any, use_fast: bool) -> None:
    """The prompt ends with the first two of 日's three byte tokens; the third, generated, must
    produce the whole character (the prompt's bytes were never emitted)."""
    tok = byte_fallback_tokenizer
    ids = tok.encode("a日", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids)[-3:] == ["<0xE6>", "<0x97>", "<0xA5>"]
    detok = IncrementalDetokenizer.from_new_request(tok, ids[:-1], SamplingParams(), use_fast=use_fast)
    detok.update(ids[-1:], False)
    assert detok.output_text == "日"


@pytest.mark.parametrize("use_fast", [True, False])
def test_a_prompt_ending_inside_an_emoji_does_not_repeat_its_tail(smollm2_tokenizer: Any,
                                                                  use_fast: bool) -> None:
    """Byte-level BPE: the prompt "Hi 🎉" less its last token ends inside the emoji; the
    continuation is " 🎉", not the prompt's "Hi" again (a DecodeStream prefilled with that
    prompt returned "Hi 🎉")."""
    tok = smollm2_tokenizer
    ids = tok.encode("Hi 🎉")
    assert tok.decode(ids[:-1]).endswith("\ufffd")
    detok = IncrementalDetokenizer.from_new_request(tok, ids[:-1], SamplingParams(), use_fast=use_fast)
    detok.update(ids[-1:], False)
    assert detok.output_text == " 🎉"


def test_a_stop_token_arriving_with_other_tokens_is_the_last_token_id(smollm2_tokenizer: Any) -> None:
    """Several tokens in one update (speculative decoding), the last a stop token: its text is
    left out, and it is still the last of token_ids."""
    tok = smollm2_tokenizer
    ids = tok.encode(" hello world")
    period = tok.encode(".")[0]
    detok = IncrementalDetokenizer.from_new_request(tok, [], SamplingParams(stop_token_ids=[period]))
    assert detok.update(ids + [period], True) is None
    assert detok.token_ids == ids + [period] and detok.output_text == " hello world"


def test_a_stop_string_that_ends_where_the_first_min_tokens_text_ends_never_ends_the_request() -> None:
    """min_tokens=2: "STOP" is the whole text of the first token; the second token's "x" is
    checked, and a match may start up to len(stop) - 1 characters before it, not len(stop)."""
    detok = IncrementalDetokenizer(SamplingParams(stop=["STOP"], min_tokens=2),
                                   _PieceDecoder(["STOP", "x", "STO", "P"]))
    assert [detok.update([t], False) for t in range(4)] == [None, None, None, "STOP"]
    assert detok.output_text == "STOPx"


def test_the_earliest_stop_string_completed_by_one_token_wins_and_ties_go_to_the_first_listed() -> None:
    """"abcd" completes "bcd" (at 1) and "cd" (at 2) with its last token: "bcd" wins, wherever
    it is listed; "c" and "cd" both start at 2: the one listed first wins."""
    for stops in (["bcd", "cd"], ["cd", "bcd"]):
        detok = IncrementalDetokenizer(SamplingParams(stop=stops), _PieceDecoder(["ab", "cd"]))
        assert [detok.update([t], False) for t in range(2)] == [None, "bcd"]
        assert detok.output_text == "a"
    for stops, first in ((["c", "cd"], "c"), (["cd", "c"], "cd")):
        detok = IncrementalDetokenizer(SamplingParams(stop=stops, include_stop_str_in_output=True),
                                       _PieceDecoder(["ab", "cd"]))
        assert [detok.update([t], False) for t in range(2)] == [None, first]
        assert detok.output_text == "ab" + first


class _CountingTokenizer:
    """A tokenizer that counts the token ids it is asked to decode or convert."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.ids_seen = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.ids_seen += len(ids)
        return self._tokenizer.decode(ids, **kwargs)

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        self.ids_seen += 1 if isinstance(ids, int) else len(ids)
        return self._tokenizer.convert_ids_to_tokens(ids)


def test_a_long_prompt_primes_the_decoder_with_a_short_tail(byte_fallback_tokenizer: Any) -> None:
    """A request's detokenizer costs the same for a prompt of 5 or of 3000 tokens: it
    decodes a short tail of the prompt (a few tokens past the last character boundary), never
    the whole prompt."""
    tok = _CountingTokenizer(byte_fallback_tokenizer)
    ids = byte_fallback_tokenizer.encode("the cat " * 1000 + "a日", add_special_tokens=False)
    assert len(ids) > 3000
    detok = IncrementalDetokenizer.from_new_request(tok, ids[:-1], SamplingParams(), use_fast=False)
    assert tok.ids_seen < 200
    detok.update(ids[-1:], False)  # the prompt ended inside 日
    assert detok.output_text == "日"


@pytest.mark.parametrize("use_fast", [True, False])
@pytest.mark.parametrize("num_special", [1, 3, 4, 30])
def test_a_prompt_ending_in_skipped_special_tokens_keeps_the_continuation_s_first_space(
        byte_fallback_tokenizer: Any, use_fast: bool, num_special: int) -> None:
    """SentencePiece's decoder strips the text's first space. "hi" and then special tokens that
    decoding skips: the continuation " there" keeps its space (a context of only the special
    tokens decoded to nothing, and the stripped space was the continuation's)."""
    tok = byte_fallback_tokenizer
    prompt = tok.encode("hi", add_special_tokens=False) + [tok.eos_token_id, tok.bos_token_id] * num_special
    prompt = prompt[:len(prompt) - num_special]
    ids = tok.encode(" there", add_special_tokens=False)
    detok = IncrementalDetokenizer.from_new_request(tok, prompt, SamplingParams(), use_fast=use_fast)
    _feed(detok, ids, [1])
    assert detok.output_text == _expected(tok, prompt, ids) == "  there"
