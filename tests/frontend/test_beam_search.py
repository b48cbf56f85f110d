"""BeamSearch against an exhaustive search over a synthetic model, and LLM.beam_search on a tiny Llama."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from lm_console.engine.errors import InvalidSamplingParamsError
from lm_console.engine.frontend.beam_search import BeamSearch, BeamSearchParams, beam_score

VOCAB = 4
EOS = 3
PROMPT = [7, 8]


def synthetic_logprobs(tokens: list[int]) -> dict[int, float]:
    """A deterministic next-token distribution over VOCAB tokens for any sequence (a fake model)."""
    rng = random.Random(hash(tuple(tokens)) & 0xFFFFFFFF)
    weights = [rng.random() ** 3 + 1e-3 for _ in range(VOCAB)]
    total = sum(weights)
    return {t: math.log(w / total) for t, w in enumerate(weights)}


def run(params: BeamSearchParams, stop_ids: set[int]) -> list[tuple[list[int], float]]:
    search = BeamSearch(PROMPT, params, stop_ids)
    while pending := search.pending():
        # As the engine answers: the 2 x beam_width most likely next tokens of each beam.
        search.advance([dict(sorted(synthetic_logprobs(t).items(), key=lambda kv: -kv[1])[:2 * params.beam_width])
                        for t in pending])
    result = search.result(lambda ids: " ".join(map(str, ids)))
    return [(beam.token_ids, beam.cum_logprob) for beam in result.sequences]


def exhaustive(max_tokens: int, beam_width: int, length_penalty: float, stop_ids: set[int]) -> list[float]:
    """The best beam_width scores over every sequence: ended by a stop token, or max_tokens long."""
    scored = []
    for length in range(1, max_tokens + 1):
        for seq in itertools.product(range(VOCAB), repeat=length):
            if any(t in stop_ids for t in seq[:-1]):
                continue
            ends = seq[-1] in stop_ids
            if not ends and length < max_tokens:
                continue
            cum = sum(synthetic_logprobs(PROMPT + list(seq[:i]))[seq[i]] for i in range(length))
            num_tokens = len(PROMPT) + length - (1 if ends else 0)
            scored.append(beam_score(num_tokens, cum, length_penalty))
    return sorted(scored, reverse=True)[:beam_width]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
@pytest.mark.parametrize("stop_ids", [set(), {EOS}], ids=["no-stop", "eos"])
def test_wide_beam_equals_exhaustive_search(length_penalty: float, stop_ids: set[int]) -> None:
    # beam_width 16 >= every live set (4^2): nothing is pruned, so beam search is exhaustive.
    params = BeamSearchParams(beam_width=16, max_tokens=3, length_penalty=length_penalty)
    got = run(params, stop_ids)
    expected = exhaustive(3, 16, length_penalty, stop_ids)
    scores = [beam_score(len(PROMPT) + len(ids) - (1 if ids and ids[-1] in stop_ids else 0), cum, length_penalty)
              for ids, cum in got]
    assert scores == pytest.approx(expected)
    assert scores == sorted(scores, reverse=True)
    if stop_ids:
        assert any(ids and ids[-1] == EOS for ids, _ in got) is False  # stop tokens are left out of the text


def test_width_one_is_greedy_and_width_two_finds_a_better_sequence() -> None:
    greedy = list(PROMPT)
    for _ in range(3):
        probs = synthetic_logprobs(greedy)
        greedy.append(max(probs, key=probs.__getitem__))
    one = run(BeamSearchParams(beam_width=1, max_tokens=3), set())
    assert one[0][0] == greedy[len(PROMPT):]
    best = exhaustive(3, 1, 1.0, set())[0]
    greedy_cum = one[0][1]
    wide = run(BeamSearchParams(beam_width=16, max_tokens=3), set())
    assert wide[0][1] == pytest.approx(best * (len(PROMPT) + 3))  # score = cum / length
    assert wide[0][1] >= greedy_cum


def test_include_stop_str_and_ignore_eos() -> None:
    with_stop = run(BeamSearchParams(beam_width=16, max_tokens=3, include_stop_str_in_output=True), {EOS})
    assert any(ids[-1] == EOS for ids, _ in with_stop)
    ignoring = BeamSearch(PROMPT, BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=True), {EOS})
    assert ignoring.stop_token_ids == set()


@pytest.mark.parametrize("fields", [dict(beam_width=0), dict(beam_width=True), dict(max_tokens=0),
                                    dict(length_penalty=float("inf")), dict(ignore_eos=1)])
def test_params_are_validated(fields: dict) -> None:
    with pytest.raises(InvalidSamplingParamsError, match="BeamSearchParams"):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **fields})


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    from lm_console.engine import LLM

    engine = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=256, num_threads=1)
    yield engine
    engine.shutdown()


def test_llm_beam_search_scores_are_the_models(llm) -> None:
    """Each beam's cumulative logprob is the model's: re-scored from prompt logprobs of prompt + beam."""
    from lm_console.engine import SamplingParams

    prompts = ["The history of computing", {"prompt_token_ids": [1, 2, 3, 4]}]
    outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=5))
    assert len(outputs) == 2
    for output in outputs:
        assert len(output.sequences) == 3
        assert len({tuple(beam.token_ids) for beam in output.sequences}) == 3  # distinct beams
        num_prompt = len(output.prompt_token_ids)
        for beam in output.sequences:
            assert len(beam.token_ids) == 5 and beam.finish_reason == "length"
            rescored = llm.generate({"prompt_token_ids": output.prompt_token_ids + beam.token_ids},
                                    SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
            cum = sum(rescored.prompt_logprobs[num_prompt + i][t].logprob for i, t in enumerate(beam.token_ids))
            assert beam.cum_logprob == pytest.approx(cum, abs=1e-3)
            assert beam.text == llm.get_tokenizer().decode(beam.token_ids, skip_special_tokens=True)
        scores = [beam_score(len(b.tokens), b.cum_logprob, 1.0) for b in output.sequences]
        assert scores == sorted(scores, reverse=True)
        greedy = llm.generate({"prompt_token_ids": output.prompt_token_ids},
                              SamplingParams(temperature=0.0, max_tokens=5, logprobs=0), use_tqdm=False)[0].outputs[0]
        greedy_cum = sum(entry[t].logprob for entry, t in zip(greedy.logprobs, greedy.token_ids))
        assert output.sequences[0].cum_logprob >= greedy_cum - 1e-4  # never worse than greedy


def test_llm_beam_search_refuses_too_wide_a_beam(llm) -> None:
    with pytest.raises(InvalidSamplingParamsError, match="max_logprobs"):
        llm.beam_search("Hi", BeamSearchParams(beam_width=11, max_tokens=2))  # 22 logprobs > 20
