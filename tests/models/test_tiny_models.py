"""The tiny test models are not degenerate: their greedy output depends on the whole context.

Every equality test on a tiny model (TP, DP, async scheduling, Ray, prefix caching, HF exactness)
is only as strong as the model is sensitive: if its greedy output ignores the attention, a layer or
the positions, an engine that breaks them still matches. So each tiny text model must change the
greedy output (8 tokens) of at least MIN_CHANGED of 20 random prompts when its attention output
is zeroed, when its first or its last layer is skipped, or when the positions are off by one from the last
prompt token on (tests/sensitivity.py), and fewer than MAX_REPEAT of its outputs may start with
the prompt's last token (a tied head's failure mode: it echoes the input).
"""

from __future__ import annotations

import pytest

from sensitivity import last_token_repeat, load, measure

# The Llama most tests use in `make test-fast`; the others (5-20 s each on 2 cores) with the slow tests.
TINY_TEXT_MODELS = ["tiny_llama_dir"] + [
    pytest.param(name, marks=pytest.mark.slow)
    for name in ("tiny_llama3_rope_dir", "tiny_mistral_dir", "tiny_llama_d64_dir", "tiny_qwen2_dir", "tiny_qwen3_dir",
                 "tiny_gemma3_dir")]
MIN_CHANGED = 0.8
MAX_REPEAT = 0.1


@pytest.mark.parametrize("fixture", TINY_TEXT_MODELS)
def test_tiny_model_greedy_output_depends_on_the_whole_context(request: pytest.FixtureRequest, fixture: str) -> None:
    model = load(request.getfixturevalue(fixture))
    assert not model.config.tie_word_embeddings
    s = measure(model)
    print(f"{fixture}: {s}")
    assert s.zero_attention >= MIN_CHANGED, s
    assert s.drop_layer >= MIN_CHANGED, s
    assert s.shift_positions >= MIN_CHANGED, s
    assert s.last_token_repeat < MAX_REPEAT, s


def test_the_check_fails_on_a_tied_echoing_model(tmp_path) -> None:  # noqa: ANN001
    """Negative control: the old tiny Llama (tied embeddings) echoes its last prompt token (19 of
    20 outputs start with it); the same measurement flags it."""
    from model_factory import make_tiny_model_dir

    repeat = last_token_repeat(load(make_tiny_model_dir(tmp_path, "llama", tie_word_embeddings=True)))
    print(f"tied llama: last-token-repeat {repeat:.2f}")
    assert repeat >= MAX_REPEAT
