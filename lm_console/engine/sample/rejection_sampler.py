"""RejectionSampler: verification of proposed (draft) tokens against the target's logits.

A request with k drafts d_0..d_{k-1} has k + 1 logits rows: row j is the target's distribution
for the token after d_0..d_{j-1}. The sampler keeps a prefix of the drafts and adds one token
of the target's own, so every step yields between 1 and k + 1 tokens:

- greedy rows accept d_j while it is the row's argmax (lowest index on ties, as the Sampler),
  then take the argmax of the first row that disagreed (or of the last row, the bonus token):
  the output is token for token the one without speculation.
- random rows run strict rejection sampling for a draft distribution q that puts all its mass
  on d_j (model-free proposers are deterministic): d_j is accepted with probability
  min(1, p(d_j) / q(d_j)) = p(d_j); on rejection the token is drawn from the recovered
  distribution max(p - q, 0) normalised, which is p with d_j removed. Each emitted token then
  has exactly the target's distribution p (the processed one: temperature, min_p, top_k,
  top_p). A seeded request draws every uniform and every token from its own generator.

Penalties and min_tokens see, at row j, the output so far plus d_0..d_{j-1} (the metadata's
output_token_ids per row), so a row is processed as if its drafts had been sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lm_console.engine.sample import ops
from lm_console.engine.sample.logprobs import LogprobsTensors, compute_logprobs_tensors
from lm_console.engine.sample.metadata import _GREEDY_EPSILON, SamplingMetadata


@dataclass(slots=True)
class RejectionSamplerOutput:
    """Per request, the accepted drafts and one target token; their rows' logprobs if asked."""

    token_ids: list[list[int]]
    logprobs_tensors: LogprobsTensors | None  # one row per emitted token, requests in order


class RejectionSampler:
    """Verifies drafts: `forward(logits, metadata, draft_token_ids)`.

    logits: [R, V] float32 with R = sum(len(d) + 1 for d in draft_token_ids), each request's
    rows consecutive (modified in place); metadata: one row per logits row, a seeded request's
    generator on its first row only.
    """

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata,
                draft_token_ids: list[list[int]]) -> RejectionSamplerOutput:
        num_rows = logits.shape[0]
        starts: list[int] = []
        row = 0
        for drafts in draft_token_ids:
            starts.append(row)
            row += len(drafts) + 1
        if row != num_rows:
            raise ValueError(f"{num_rows} logits rows for drafts needing {row}")
        raw_logprobs = logits.log_softmax(dim=-1) if metadata.max_num_logprobs is not None else None
        if metadata.min_tokens:
            ops.apply_min_tokens(logits, metadata)
        if not metadata.no_penalties:
            ops.apply_penalties(logits, metadata)
        argmax = None if metadata.all_random else ops.greedy_argmax(logits).tolist()
        probs = None
        is_greedy: list[bool] = [True] * num_rows
        if not metadata.all_greedy:
            temperature = metadata.temperature
            assert temperature is not None
            is_greedy = (temperature < _GREEDY_EPSILON).tolist()
            temperature = torch.where(temperature < _GREEDY_EPSILON, torch.ones_like(temperature), temperature)
            logits.div_(temperature.unsqueeze(1))
            if metadata.min_p is not None:
                ops.apply_min_p(logits, metadata.min_p)
            if metadata.top_k is not None or metadata.top_p is not None:
                ops.apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
            probs = logits.softmax(dim=-1)
        token_ids: list[list[int]] = []
        emitted_rows: list[int] = []
        for start, drafts in zip(starts, draft_token_ids):
            if is_greedy[start]:
                assert argmax is not None
                tokens = accept_greedy(drafts, argmax[start:start + len(drafts) + 1])
            else:
                assert probs is not None
                tokens = accept_random(probs[start:start + len(drafts) + 1], drafts,
                                       metadata.generators.get(start))
            token_ids.append(tokens)
            emitted_rows.extend(range(start, start + len(tokens)))
        logprobs_tensors = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            index = torch.tensor(emitted_rows, dtype=torch.int64, device=logits.device)
            emitted = torch.tensor([t for tokens in token_ids for t in tokens], dtype=torch.int64,
                                   device=logits.device)
            logprobs_tensors = compute_logprobs_tensors(raw_logprobs.index_select(0, index), emitted,
                                                        metadata.max_num_logprobs)
        return RejectionSamplerOutput(token_ids, logprobs_tensors)

    __call__ = forward


def accept_greedy(drafts: list[int], argmax: list[int]) -> list[int]:
    """The drafts while they equal the target's argmax, then the argmax where they stopped."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == argmax[accepted]:
        accepted += 1
    return [*drafts[:accepted], argmax[accepted]]


def accept_random(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None) -> list[int]:
    """Strict rejection sampling of deterministic drafts against probs [len(drafts) + 1, V]."""
    num_drafts = len(drafts)
    if num_drafts:
        uniforms = torch.rand(num_drafts, generator=generator, device=probs.device).tolist()
        index = torch.arange(num_drafts, device=probs.device)
        draft_probs = probs[index, torch.tensor(drafts, device=probs.device)].tolist()
        for j, (draft, u, p) in enumerate(zip(drafts, uniforms, draft_probs)):
            if u < p:
                continue
            recovered = probs[j].clone()
            recovered[draft] = 0.0
            if not bool(recovered.sum() > 0):  # p(draft) rounded below 1 with nothing else left
                continue
            return [*drafts[:j], _draw(recovered, generator)]
    return [*drafts, _draw(probs[num_drafts], generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn with probability proportional to weights (need not sum to 1)."""
    return int(torch.multinomial(weights, 1, generator=generator).item())
