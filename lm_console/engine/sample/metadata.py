"""SamplingMetadata: the batch's sampling settings as tensors, one row per request."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lm_console.engine.sampling_params import SamplingParams

_GREEDY_EPSILON = 1e-5  # temperature below this means greedy (as SamplingParams.is_greedy)


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling settings for one Sampler call.

    Invariants: a tensor field is None when no row needs that stage, so the Sampler can skip it;
    temperature holds each row's own value, greedy rows below _GREEDY_EPSILON; top_k rows
    without top-k hold vocab_size; output_token_ids may be the live per-request lists (the
    Sampler reads their lengths and contents at call time, so the metadata can be reused
    across steps while the batch does not change).
    """

    temperature: torch.Tensor | None  # [B] float32; None when all rows are greedy
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [B] float32; None when no random row uses top-p
    top_k: torch.Tensor | None  # [B] int64, vocab_size = off; None when no random row uses it
    min_p: torch.Tensor | None  # [B] float32; None when no random row uses min-p
    generators: dict[int, torch.Generator]  # row -> the seeded request's own generator
    max_num_logprobs: int | None  # widest logprobs request of the batch; None: none asked
    no_penalties: bool
    prompt_token_ids: torch.Tensor | None  # [B, max_prompt_len] int64 padded with vocab_size
    output_token_ids: list[list[int]]  # per row, the tokens generated so far
    frequency_penalties: torch.Tensor | None  # [B] float32; None when all rows are 0
    presence_penalties: torch.Tensor | None  # [B] float32; None when all rows are 0
    repetition_penalties: torch.Tensor | None  # [B] float32; None when all rows are 1
    # row -> (min_tokens, stop token ids masked while the row has fewer output tokens)
    min_tokens: dict[int, tuple[int, set[int]]] = field(default_factory=dict)
    # Every row's logit_bias entries flattened: (rows [E] int64, token ids [E] int64, biases [E]
    # float32), one index_put_ for the whole batch; None when no row has a bias.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Rows with allowed_token_ids and their masks: (rows [R] int64, [R, V] bool, True = not allowed);
    # None when no row restricts its tokens.
    disallowed: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_rows(self) -> int:
        """Rows (requests) in the batch."""
        return len(self.output_token_ids)

    @classmethod
    def from_params(cls, params_list: list[SamplingParams], output_token_ids: list[list[int]],
                    prompt_token_ids: list[list[int]], generators: dict[int, torch.Generator],
                    vocab_size: int, device: torch.device | str) -> SamplingMetadata:
        """Build the metadata for rows params_list[i]; only the tensors some row needs."""
        num_rows = len(params_list)
        greedy = [p.temperature < _GREEDY_EPSILON for p in params_list]
        all_greedy = all(greedy)
        all_random = not any(greedy)
        random_params = [p for p, g in zip(params_list, greedy) if not g]

        def row_tensor(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        temperature = top_p = top_k = min_p = None
        if not all_greedy:
            temperature = row_tensor([float(p.temperature) for p in params_list], torch.float32)
            # Greedy rows get neutral values: the filters would only waste time on them.
            if any(p.top_p < 1.0 for p in random_params):
                top_p = row_tensor([1.0 if g else float(p.top_p)
                                    for p, g in zip(params_list, greedy)], torch.float32)
            if any(0 < p.top_k < vocab_size for p in random_params):
                top_k = row_tensor([p.top_k if not g and 0 < p.top_k < vocab_size else vocab_size
                                    for p, g in zip(params_list, greedy)], torch.int64)
            if any(p.min_p > 0.0 for p in random_params):
                min_p = row_tensor([0.0 if g else float(p.min_p)
                                    for p, g in zip(params_list, greedy)], torch.float32)

        frequency = presence = repetition = prompt_tensor = None
        if any(p.frequency_penalty != 0.0 for p in params_list):
            frequency = row_tensor([float(p.frequency_penalty) for p in params_list], torch.float32)
        if any(p.presence_penalty != 0.0 for p in params_list):
            presence = row_tensor([float(p.presence_penalty) for p in params_list], torch.float32)
        if any(p.repetition_penalty != 1.0 for p in params_list):
            repetition = row_tensor([float(p.repetition_penalty) for p in params_list],
                                    torch.float32)
            prompt_tensor = _pad_token_ids(prompt_token_ids, vocab_size, device)

        num_logprobs = [p.logprobs for p in params_list if p.logprobs is not None]
        min_tokens = {
            row: (p.min_tokens, set(p.all_stop_token_ids))
            for row, p in enumerate(params_list)
            if p.min_tokens > 0 and p.all_stop_token_ids
        }
        assert len(output_token_ids) == num_rows
        return cls(
            logit_bias=_logit_bias(params_list, vocab_size, device),
            disallowed=_disallowed(params_list, vocab_size, device),
            temperature=temperature,
            all_greedy=all_greedy,
            all_random=all_random,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            # A greedy row never draws: leave its generator out so nothing is spent on it.
            generators={row: g for row, g in generators.items() if not greedy[row]},
            max_num_logprobs=max(num_logprobs) if num_logprobs else None,
            no_penalties=frequency is None and presence is None and repetition is None,
            prompt_token_ids=prompt_tensor,
            output_token_ids=output_token_ids,
            frequency_penalties=frequency,
            presence_penalties=presence,
            repetition_penalties=repetition,
            min_tokens=min_tokens,
        )


def _logit_bias(params_list: list[SamplingParams], vocab_size: int,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    ids: list[int] = []
    biases: list[float] = []
    for row, params in enumerate(params_list):
        for token_id, bias in (params.logit_bias or {}).items():
            if token_id < vocab_size:  # the InputProcessor refused larger ids; padding columns stay put
                rows.append(row)
                ids.append(token_id)
                biases.append(float(bias))
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.int64, device=device), torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(biases, dtype=torch.float32, device=device))


def _disallowed(params_list: list[SamplingParams], vocab_size: int,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows = [row for row, params in enumerate(params_list) if params.allowed_token_ids]
    if not rows:
        return None
    mask = torch.ones((len(rows), vocab_size), dtype=torch.bool, device=device)
    for i, row in enumerate(rows):
        allowed = [t for t in params_list[row].allowed_token_ids or () if t < vocab_size]
        mask[i, torch.tensor(allowed, dtype=torch.int64, device=device)] = False
    return torch.tensor(rows, dtype=torch.int64, device=device), mask


def _pad_token_ids(token_ids: list[list[int]], pad_id: int,
                   device: torch.device | str) -> torch.Tensor:
    """[B, max_len] int64, rows padded with pad_id (vocab_size: a column nobody samples)."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    padded = [list(ids) + [pad_id] * (max_len - len(ids)) for ids in token_ids]
    return torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(token_ids), max_len)
