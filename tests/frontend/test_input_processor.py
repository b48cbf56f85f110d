"""InputProcessor limits (issue 18 item 5): logprobs bounded by max_logprobs, and a prompt text that
cannot fit max_model_len refused before it is tokenised."""

from __future__ import annotations

import pytest

from lm_console.engine.errors import InvalidPromptError, InvalidSamplingParamsError
from lm_console.engine.frontend.input_processor import InputProcessor
from lm_console.engine.frontend.prompt_length import max_chars_per_token
from lm_console.engine.frontend.tokenizer import load_tokenizer
from lm_console.engine.sampling_params import SamplingParams


class CountingTokenizer:
    """The real tokenizer, counting the characters it is asked to encode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.backend_tokenizer = tokenizer.backend_tokenizer
        self.encoded_chars = 0

    def get_vocab(self):
        return self.tokenizer.get_vocab()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded_chars += len(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


def test_a_text_too_long_for_max_model_len_is_never_tokenised(tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    processor = InputProcessor(counting, max_model_len=128, vocab_size=len(tokenizer), eos_token_id=None)
    per_token = max_chars_per_token(tokenizer)
    assert per_token == max(len(t) for t in tokenizer.get_vocab()) and processor.max_prompt_chars == 128 * per_token
    # The longest token string repeated: as many characters per token as this tokenizer allows.
    longest = max(tokenizer.get_vocab(), key=len)
    for prompt in ("x" * 10_000_000, {"prompt": "y" * (128 * per_token + 1)}):
        with pytest.raises(InvalidPromptError, match="characters"):
            processor.process_inputs("r", prompt, SamplingParams())
    assert counting.encoded_chars == 0  # on main the 10 MB prompt was tokenised first (3.1 GB peak)
    with pytest.raises(InvalidPromptError, match="tokens"):  # within the bound: tokenised, then refused
        processor.process_inputs("r", "word " * 1000, SamplingParams())
    assert counting.encoded_chars == 5000
    assert len(tokenizer.encode(tokenizer.convert_tokens_to_string([longest]), add_special_tokens=False)) >= 1
    _, request = processor.process_inputs("r", "a short prompt", SamplingParams())
    assert request.prompt_token_ids


def test_logprobs_are_bounded_by_max_logprobs(tokenizer) -> None:
    processor = InputProcessor(tokenizer, max_model_len=128, vocab_size=len(tokenizer), eos_token_id=None)
    processor.process_inputs("r", "hi", SamplingParams(logprobs=20))
    for params in (SamplingParams(logprobs=21), SamplingParams(logprobs=10**6)):
        with pytest.raises(InvalidSamplingParamsError, match="max_logprobs=20"):
            processor.process_inputs("r", "hi", params)
    processor.process_inputs("r", "hi", SamplingParams(prompt_logprobs=20))
    with pytest.raises(InvalidSamplingParamsError, match="prompt_logprobs=21 is invalid: at most max_logprobs=20"):
        processor.process_inputs("r", "hi", SamplingParams(prompt_logprobs=21))
    unlimited = InputProcessor(tokenizer, max_model_len=128, vocab_size=len(tokenizer), eos_token_id=None,
                               max_logprobs=-1)
    unlimited.process_inputs("r", "hi", SamplingParams(logprobs=1000))


def test_a_tokenizer_that_can_drop_characters_gets_no_bound(byte_fallback_tokenizer) -> None:
    """Strip / BERT-style normalisers or fused <unk> break the bound: then there is none."""
    import copy

    from tokenizers import normalizers

    assert max_chars_per_token(byte_fallback_tokenizer) is not None  # Prepend + Replace keep characters
    stripping = copy.deepcopy(byte_fallback_tokenizer)  # the fixture is shared: change a copy
    stripping.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.Strip()])
    assert max_chars_per_token(stripping) is None
    assert max_chars_per_token(byte_fallback_tokenizer) is not None
    assert max_chars_per_token(object()) is None
