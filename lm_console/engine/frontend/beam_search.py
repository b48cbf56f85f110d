"""Beam search in the frontend, over one-token generate steps with logprobs (as vLLM does it).

Each step asks the engine for one token of every live beam with the 2 x beam_width most likely
next tokens and their log-probabilities; every (beam, token) pair becomes a candidate whose score
is its cumulative log-probability divided by its length to the power length_penalty (the length
counts the prompt's tokens, and not an ending EOS, as vLLM's score does). A candidate that ends
with a stop token (EOS, or one of stop_token_ids) is complete unless ignore_eos; the best
beam_width of the others live on. After max_tokens steps (or when no beam is left) the best
beam_width of the complete and live beams are the result, best first.

The prefix cache makes each step's prompt (the beam so far) cost one token of compute once its
parent's blocks are cached. Torch-free: the offline LLM and the server's AsyncLLM both drive it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lm_console.engine.errors import InvalidSamplingParamsError
from lm_console.engine.sampling_params import MAX_N, RequestOutputKind, SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams: beam_width beams (and results), up to max_tokens new tokens each."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # keep the stop token's text at the end of the result
    skip_special_tokens: bool = True  # how the results' text is decoded

    def __post_init__(self) -> None:
        def fail(name: str, allowed: str) -> None:
            raise InvalidSamplingParamsError(f"BeamSearchParams.{name}={getattr(self, name)!r:.80} is invalid: "
                                             f"{allowed}.")

        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_N:
            fail("beam_width", f"beam_width must be an integer in [1, {MAX_N}]")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            fail("max_tokens", "max_tokens must be an integer >= 1")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)) \
                or not math.isfinite(self.length_penalty):
            fail("length_penalty", "length_penalty must be a finite number")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                fail(name, f"{name} must be True or False")

    def step_params(self) -> SamplingParams:
        """The SamplingParams of one step: one token, the 2 x beam_width best candidates' logprobs."""
        return SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * self.beam_width, ignore_eos=True,
                              output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass
class BeamSearchSequence:
    """One beam: the prompt's tokens and its own, its cumulative logprob, and once done its text."""

    tokens: list[int]
    num_prompt_tokens: int
    cum_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)  # each generated token's logprob
    text: str | None = None
    finish_reason: str | None = None  # "stop" (a stop token) | "length"
    stop_reason: int | None = None  # the stop token that completed it

    @property
    def token_ids(self) -> list[int]:
        """The generated tokens (the stop token included only with include_stop_str_in_output)."""
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The result for one prompt: beam_width sequences, best first."""

    sequences: list[BeamSearchSequence]
    prompt_token_ids: list[int]


def beam_score(num_tokens: int, cum_logprob: float, length_penalty: float) -> float:
    """vLLM's beam score: the cumulative logprob over (length ** length_penalty)."""
    return cum_logprob / (max(num_tokens, 1) ** length_penalty)


class BeamSearch:
    """The beam search of one prompt; drive it with pending() / advance() until done."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, stop_token_ids: set[int]) -> None:
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.stop_token_ids = set() if params.ignore_eos else set(stop_token_ids)
        self.live = [BeamSearchSequence(tokens=list(prompt_token_ids), num_prompt_tokens=len(prompt_token_ids))]
        # (score, sequence) of every completed beam; the length of the score leaves the stop token out.
        self.completed: list[tuple[float, BeamSearchSequence]] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.params.max_tokens

    def pending(self) -> list[list[int]]:
        """The token lists of the live beams: each needs one step."""
        return [] if self.done else [beam.tokens for beam in self.live]

    def advance(self, candidates: list[dict[int, float]]) -> None:
        """One step: candidates[i] maps the next tokens of live beam i to their logprobs."""
        if len(candidates) != len(self.live):
            raise ValueError(f"advance() needs one candidate map per live beam ({len(self.live)}), "
                             f"got {len(candidates)}")
        penalty = self.params.length_penalty
        grown: list[tuple[float, int, BeamSearchSequence]] = []
        for beam, top in zip(self.live, candidates):
            for token_id, logprob in top.items():
                cum = beam.cum_logprob + logprob
                if token_id in self.stop_token_ids:
                    tokens = beam.tokens + [token_id] if self.params.include_stop_str_in_output else beam.tokens
                    done = BeamSearchSequence(tokens=list(tokens), num_prompt_tokens=beam.num_prompt_tokens,
                                              cum_logprob=cum, logprobs=beam.logprobs + [logprob],
                                              finish_reason="stop", stop_reason=token_id)
                    self.completed.append((beam_score(len(beam.tokens), cum, penalty), done))
                else:
                    child = BeamSearchSequence(tokens=beam.tokens + [token_id], num_prompt_tokens=beam.num_prompt_tokens,
                                               cum_logprob=cum, logprobs=beam.logprobs + [logprob])
                    # The insertion order breaks ties: stable across runs, as the engine's logprobs are.
                    grown.append((beam_score(len(child.tokens), cum, penalty), len(grown), child))
        grown.sort(key=lambda item: (-item[0], item[1]))
        self.live = [child for _, _, child in grown[:self.params.beam_width]]
        self.steps += 1

    def result(self, decode: Callable[[list[int]], str]) -> BeamSearchOutput:
        """The best beam_width beams, complete or not, best first, with their text."""
        penalty = self.params.length_penalty
        ranked = list(self.completed)
        for beam in self.live:
            beam.finish_reason = "length"
            ranked.append((beam_score(len(beam.tokens), beam.cum_logprob, penalty), beam))
        order = sorted(range(len(ranked)), key=lambda i: (-ranked[i][0], i))
        best = [ranked[i][1] for i in order[:self.params.beam_width]]
        for beam in best:
            beam.text = decode(beam.token_ids)
        return BeamSearchOutput(sequences=best, prompt_token_ids=self.prompt_token_ids)


def start_searches(input_processor: Any, prompts: list[Any], params: BeamSearchParams) -> list[BeamSearch]:
    """One BeamSearch per prompt (str, {"prompt": str} or {"prompt_token_ids": [...]}), checked first:
    beam_width against max_logprobs, each prompt plus max_tokens against max_model_len."""
    from lm_console.engine.errors import InvalidPromptError

    check_beam_width(params.beam_width, input_processor.max_logprobs)
    stop_ids = set(input_processor.extra_stop_token_ids)
    if input_processor.eos_token_id is not None:
        stop_ids.add(input_processor.eos_token_id)
    searches = []
    for prompt in prompts:
        _, token_ids = input_processor.tokenize_prompt(prompt)
        if len(token_ids) + params.max_tokens > input_processor.max_model_len:
            raise InvalidPromptError(
                f"A prompt of {len(token_ids)} tokens plus max_tokens={params.max_tokens} exceeds max_model_len="
                f"{input_processor.max_model_len}; shorten the prompt or lower max_tokens.")
        searches.append(BeamSearch(token_ids, params, stop_ids))
    return searches


def candidates_of(output: Any) -> dict[int, float]:
    """The token -> logprob map of a one-token step's RequestOutput."""
    completion = output.outputs[0]
    if not completion.logprobs:
        raise RuntimeError("a beam search step came back without logprobs")
    return {token_id: entry.logprob for token_id, entry in completion.logprobs[0].items()}


def check_beam_width(beam_width: int, max_logprobs: int) -> None:
    """InvalidSamplingParamsError when a step would ask for more logprobs than the engine allows."""
    if 0 <= max_logprobs < 2 * beam_width:
        raise InvalidSamplingParamsError(
            f"BeamSearchParams.beam_width={beam_width} is invalid: each step asks for 2 x beam_width logprobs, "
            f"more than this engine's max_logprobs={max_logprobs}; use beam_width <= {max_logprobs // 2} or "
            "start the engine with a larger max_logprobs.")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


__all__ = ["start_searches", "BeamSearch", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "beam_score",
           "candidates_of", "check_beam_width"]
