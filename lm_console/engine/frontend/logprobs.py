"""LogprobsProcessor: LogprobsLists rows -> vLLM's per-token {token_id: Logprob} dicts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lm_console.engine.protocol import LogprobsLists
from lm_console.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class Logprob:
    """One token's log-probability, its 1-based rank in the vocabulary, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # one dict per generated token
PromptLogprobs = list[dict[int, Logprob] | None]  # one per prompt token; the first is None


@dataclass(slots=True)
class LogprobsProcessor:
    """Accumulates a request's sample (and prompt) logprobs and its cumulative logprob.

    Invariants: logprobs is None iff the request did not ask for logprobs, and then
    cumulative_logprob is None too; otherwise logprobs has one dict per generated token whose
    first key is that token (with its true rank), followed by the top num_logprobs tokens.
    """

    tokenizer: Any
    num_logprobs: int | None
    num_prompt_logprobs: int | None
    logprobs: SampleLogprobs | None
    prompt_logprobs: PromptLogprobs | None
    cumulative_logprob: float | None
    num_prompt_positions: int = 0  # prompt positions covered so far, popped or not
    num_prompt_popped: int = 0  # prompt positions handed out by pop_prompt_logprobs()

    @classmethod
    def from_new_request(cls, tokenizer: Any, sampling_params: SamplingParams) -> LogprobsProcessor:
        num_logprobs = sampling_params.logprobs
        num_prompt_logprobs = sampling_params.prompt_logprobs
        return cls(
            tokenizer=tokenizer,
            num_logprobs=num_logprobs,
            num_prompt_logprobs=num_prompt_logprobs,
            logprobs=None if num_logprobs is None else [],
            # The first prompt token has no logprob: None, even for a one-token prompt.
            prompt_logprobs=None if num_prompt_logprobs is None else [None],
            cumulative_logprob=None if num_logprobs is None else 0.0,
            num_prompt_positions=0 if num_prompt_logprobs is None else 1,
        )

    def update_from_output(self, new_logprobs: LogprobsLists | None) -> None:
        """Append one dict per row (one row per new token) and add to cumulative_logprob."""
        if new_logprobs is None or self.logprobs is None or self.num_logprobs is None:
            return
        assert self.cumulative_logprob is not None
        for token_ids, logprobs, rank in zip(new_logprobs.logprob_token_ids,
                                             new_logprobs.logprobs,
                                             new_logprobs.sampled_token_ranks):
            self.cumulative_logprob += logprobs[0]
            self.logprobs.append(self._make_logprob_dict(token_ids, logprobs, rank,
                                                         self.num_logprobs))

    def update_prompt_logprobs(self, prompt_logprobs: LogprobsLists | None) -> None:
        """Append rows for prompt tokens 1.. (row i: prompt token i+1); token 0 gets None."""
        if prompt_logprobs is None or self.prompt_logprobs is None:
            return
        assert self.num_prompt_logprobs is not None
        self.num_prompt_positions += len(prompt_logprobs.sampled_token_ranks)
        for token_ids, logprobs, rank in zip(prompt_logprobs.logprob_token_ids,
                                             prompt_logprobs.logprobs,
                                             prompt_logprobs.sampled_token_ranks):
            self.prompt_logprobs.append(self._make_logprob_dict(token_ids, logprobs, rank,
                                                                self.num_prompt_logprobs))

    def pop_prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt logprobs gathered since the last pop (each position is handed out once)."""
        if self.prompt_logprobs is None:
            return None
        new = self.prompt_logprobs[self.num_prompt_popped:]
        self.num_prompt_popped = len(self.prompt_logprobs)
        return new

    def new_logprobs(self, num_new_tokens: int) -> SampleLogprobs | None:
        """The dicts of the last num_new_tokens tokens (for DELTA outputs)."""
        if self.logprobs is None:
            return None
        return self.logprobs[len(self.logprobs) - num_new_tokens:] if num_new_tokens else []

    def _make_logprob_dict(self, token_ids: list[int], logprobs: list[float], rank: int,
                           num_logprobs: int) -> dict[int, Logprob]:
        """Column 0 (the selected token, true rank) first, then top-k with ranks 1..k."""
        width = min(len(token_ids), num_logprobs + 1)
        decoded = self._decode_tokens(token_ids[:width])
        result = {token_ids[0]: Logprob(logprobs[0], rank, decoded[0])}
        for column in range(1, width):
            token_id = token_ids[column]
            if token_id not in result:
                result[token_id] = Logprob(logprobs[column], column, decoded[column])
        return result

    def _decode_tokens(self, token_ids: list[int]) -> list[str | None]:
        if self.tokenizer is None:
            return [None] * len(token_ids)
        return [self.tokenizer.decode([token_id]) for token_id in token_ids]
