"""The model-free proposers against a brute-force reference, and SpeculativeConfig's validation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lm_console.engine.config.speculative import SpeculativeConfig
from lm_console.engine.core.spec_decode.proposers import NgramProposer, SuffixProposer, ngram_lookup
from lm_console.engine.errors import InvalidEngineArgsError


def reference_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for i in range(len(tokens) - n):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def reference_suffix(tokens: list[int], min_match: int, k: int) -> list[int]:
    """Longest suffix that also ends earlier; its first earlier end."""
    for n in range(len(tokens) - 1, min_match - 1, -1):
        suffix = tokens[-n:]
        for end in range(n - 1, len(tokens) - 1):
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_ngram_matches_brute_force(vocab: int) -> None:
    rng = random.Random(vocab)
    nonempty = 0
    for _ in range(300):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        got = ngram_lookup(np.asarray(tokens), 2, 5, 4)
        assert got == reference_ngram(tokens, 2, 5, 4), tokens
        nonempty += bool(got)
    assert nonempty > 50  # the comparison saw real proposals


@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_suffix_automaton_matches_brute_force_incrementally(vocab: int) -> None:
    rng = random.Random(100 + vocab)
    nonempty = 0
    for trial in range(40):
        proposer = SuffixProposer(min_match=1)
        tokens = [rng.randrange(vocab)]
        for _ in range(60):  # the automaton is extended token by token, as a request decodes
            got = proposer.propose(f"r{trial}", tokens, 3)
            assert got == reference_suffix(tokens, 1, 3), tokens
            nonempty += bool(got)
            tokens.append(rng.randrange(vocab))
        proposer.forget(f"r{trial}")
        assert not proposer._automata
    assert nonempty > 500


def test_a_broken_reference_would_be_caught() -> None:
    """Negative control: the comparisons above can fail (a proposer taking the last occurrence
    instead of the first disagrees with the reference on some inputs)."""
    rng = random.Random(0)
    disagreements = 0
    for _ in range(200):
        tokens = [rng.randrange(3) for _ in range(30)]
        last = []
        for n in range(5, 1, -1):
            suffix = tokens[-n:]
            hits = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]
            if hits:
                last = tokens[hits[-1] + n:hits[-1] + n + 4]
                break
        disagreements += last != reference_ngram(tokens, 2, 5, 4)
    assert disagreements > 0


def test_copying_text_is_proposed() -> None:
    text = list(range(100, 150))
    prompt = [1, 2, *text, 3, *text[:10]]
    for proposer in (NgramProposer(2, 5), SuffixProposer(2)):
        assert proposer.propose("a", prompt, 5) == text[10:15]
    assert NgramProposer(2, 5).propose("a", [1, 2, 3, 4], 5) == []


def test_config_defaults_and_validation() -> None:
    config = SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 4}')
    assert config is not None and (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 5)
    assert SpeculativeConfig(prompt_lookup_min=7).prompt_lookup_max == 7
    assert SpeculativeConfig(prompt_lookup_max=1).prompt_lookup_min == 1
    assert SpeculativeConfig.parse(None) is None
    for bad, message in [({"method": "eagle"}, "method"), ({"method": "ngram", "num_speculative_tokens": 0}, "num_spec"),
                         ({"method": "ngram", "num_speculative_tokens": True}, "num_spec"),
                         ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 3}, "above"),
                         ({"method": "ngram", "disable_by_batch_size": 1}, "disable_by_batch_size"),
                         ({"method": "ngram", "disable_by_batch_size": "sometimes"}, "disable_by_batch_size"),
                         ({"method": "ngram", "model": "x"}, "draft model"), ({"method": "ngram", "foo": 1}, "unknown"),
                         ({"num_speculative_tokens": 2}, "needs a 'method'"), ("{not json", "JSON"), ([1], "dict")]:
        with pytest.raises(InvalidEngineArgsError, match=message):
            SpeculativeConfig.parse(bad)  # type: ignore[arg-type]
