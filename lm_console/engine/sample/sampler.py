"""Sampler: logits -> one token per row, plus the logprobs the batch asked for."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lm_console.engine.sample import ops
from lm_console.engine.sample.logprobs import LogprobsTensors, compute_logprobs_tensors
from lm_console.engine.sample.metadata import _GREEDY_EPSILON, SamplingMetadata


@dataclass(slots=True)
class SamplerOutput:
    """The sampled tokens, and their logprobs when some row asked for them."""

    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs_tensors: LogprobsTensors | None  # [B, max_num_logprobs + 1]


class Sampler(nn.Module):
    """Stages, each skipped when no row needs it:

    raw logprobs -> allowed_token_ids -> min_tokens masking -> logit_bias -> penalties -> greedy argmax -> temperature -> min_p
    -> top_k / top_p -> random sampling (exponential race; seeded rows use their generator).

    forward() modifies `logits` in place; logprobs come from the logits as given (raw_logprobs).
    """

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        # logits: [B, V] float32
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)  # [B, V]
        if metadata.disallowed is not None:
            ops.apply_allowed_token_ids(logits, metadata.disallowed)
        if metadata.min_tokens:
            ops.apply_min_tokens(logits, metadata)
        if metadata.logit_bias is not None:
            ops.apply_logit_bias(logits, metadata.logit_bias)
        if not metadata.no_penalties:
            ops.apply_penalties(logits, metadata)
        sampled = self.sample(logits, metadata)
        logprobs_tensors = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs_tensors = compute_logprobs_tensors(raw_logprobs, sampled,
                                                        metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs_tensors)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take the argmax (lowest index on ties); the others sample. [B] int64."""
        greedy_sampled = None if metadata.all_random else ops.greedy_argmax(logits)
        if metadata.all_greedy:
            assert greedy_sampled is not None
            return greedy_sampled
        temperature = metadata.temperature
        assert temperature is not None
        is_greedy = None
        if not metadata.all_random:
            is_greedy = temperature < _GREEDY_EPSILON
            temperature = torch.where(is_greedy, torch.ones_like(temperature), temperature)
        logits.div_(temperature.unsqueeze(1))
        if metadata.min_p is not None:
            ops.apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None or metadata.top_p is not None:
            ops.apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        random_sampled = ops.random_sample(logits, metadata.generators)
        if is_greedy is None:
            return random_sampled
        return torch.where(is_greedy, greedy_sampled, random_sampled)
