"""The rejection sampler keeps the target distribution (chi-square, thousands of draws on a small
vocabulary), with negative controls; greedy acceptance is the longest matching prefix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lm_console.engine.sample import rejection_sampler as rs
from lm_console.engine.sample.metadata import SamplingMetadata
from lm_console.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

VOCAB = 6
DRAWS = 6000


def chisquare(observed, expected) -> SimpleNamespace:  # noqa: ANN001
    """Pearson's chi-square goodness of fit (scipy's chisquare, which the test env lacks): the
    p-value is the chi-square survival function, the upper regularized incomplete gamma."""
    observed, expected = torch.as_tensor(observed, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    statistic = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(observed.numel() - 1, dtype=torch.float64)
    return SimpleNamespace(statistic=float(statistic), pvalue=float(torch.special.gammaincc(df / 2, statistic / 2)))


def _metadata(params: list[SamplingParams], generators: dict[int, torch.Generator] | None = None) -> SamplingMetadata:
    return SamplingMetadata.from_params(params, [[] for _ in params], [[1] for _ in params], generators or {},
                                        VOCAB, "cpu")


def test_greedy_accepts_the_longest_matching_prefix_and_the_target_token() -> None:
    logits = torch.full((4, VOCAB), -1.0)
    for row, best in enumerate([2, 3, 5, 1]):
        logits[row, best] = 1.0
    sampler = rs.RejectionSampler()
    params = [SamplingParams(temperature=0.0)] * 4
    for drafts, expected in [([2, 3, 5], [2, 3, 5, 1]), ([2, 4, 5], [2, 3]), ([0, 3, 5], [2]), ([2, 3, 0], [2, 3, 5])]:
        out = sampler(logits.clone(), _metadata(params), [drafts])
        assert out.token_ids == [expected]
    assert sampler(logits[:1].clone(), _metadata(params[:1]), [[]]).token_ids == [[2]]


def _position_counts(accept, target: torch.Tensor, drafts: list[int], seed: int) -> list[torch.Tensor]:
    """Counts of the token emitted at each position, over DRAWS verifications, conditioned on the
    prefix the check needs: position j counts only draws that accepted d_0..d_{j-1}."""
    generator = torch.Generator().manual_seed(seed)
    counts = [torch.zeros(VOCAB) for _ in range(len(drafts) + 1)]
    for _ in range(DRAWS):
        tokens = accept(target, drafts, generator)
        for j, token in enumerate(tokens):
            counts[j][token] += 1
    return counts


def _target() -> torch.Tensor:
    """Three positions' distributions; the drafts sit on likely and unlikely tokens."""
    return torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
                         [0.05, 0.05, 0.50, 0.20, 0.10, 0.10],
                         [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])


def _p_values(accept) -> list[float]:  # noqa: ANN001
    target, drafts = _target(), [1, 2]
    counts = _position_counts(accept, target, drafts, seed=1234)
    p_values = []
    for j, count in enumerate(counts):
        total = count.sum()
        if total < 500:
            continue
        p_values.append(float(chisquare(count.numpy(), (target[j] * total).numpy()).pvalue))
    return p_values


def test_sampled_tokens_keep_the_target_distribution() -> None:
    p_values = _p_values(rs.accept_random)
    assert len(p_values) == 3  # every position was reached often enough to test
    assert min(p_values) > 1e-3, p_values


def test_negative_control_always_accepting_fails_the_chi_square() -> None:
    def always_accept(probs: torch.Tensor, drafts: list[int], generator: torch.Generator) -> list[int]:
        return [*drafts, int(torch.multinomial(probs[len(drafts)], 1, generator=generator))]

    assert min(_p_values(always_accept)) < 1e-6


def test_negative_control_resampling_from_p_without_removing_the_draft_fails() -> None:
    """Rejection that draws the replacement from p itself (not max(p - q, 0)) over-weights the draft."""
    def no_recovery(probs: torch.Tensor, drafts: list[int], generator: torch.Generator) -> list[int]:
        uniforms = torch.rand(len(drafts), generator=generator).tolist()
        for j, draft in enumerate(drafts):
            if uniforms[j] >= float(probs[j, draft]):
                return [*drafts[:j], int(torch.multinomial(probs[j], 1, generator=generator))]
        return [*drafts, int(torch.multinomial(probs[len(drafts)], 1, generator=generator))]

    assert min(_p_values(no_recovery)) < 1e-6


def test_forward_processes_temperature_top_k_and_keeps_seeds() -> None:
    """Through forward(): the emitted first token follows softmax(logits / T) restricted to the
    top-k, and a seeded request gives the same tokens for the same seed."""
    logits = torch.log(_target()).repeat(1, 1)  # 3 rows: 2 drafts + bonus
    params = [SamplingParams(temperature=0.7, top_k=4, seed=5)] * 3
    sampler = rs.RejectionSampler()
    counts = torch.zeros(VOCAB)
    generator = torch.Generator().manual_seed(99)
    for _ in range(DRAWS):
        out = sampler(logits.clone(), _metadata(params, {0: generator}), [[1, 2]])
        counts[out.token_ids[0][0]] += 1
    expected = torch.softmax(torch.log(_target()[0]) / 0.7, 0)
    expected[expected < expected.topk(4).values[-1]] = 0
    expected /= expected.sum()
    mask = expected > 0
    assert counts[~mask].sum() == 0  # nothing outside the top-k
    assert chisquare(counts[mask].numpy(), (expected[mask] * DRAWS).numpy()).pvalue > 1e-3

    def run(seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return [sampler(logits.clone(), _metadata(params, {0: g}), [[1, 2]]).token_ids[0] for _ in range(20)]

    assert run(3) == run(3) and run(3) != run(4)


def test_logprobs_of_the_emitted_tokens() -> None:
    logits = torch.log(_target())
    params = [SamplingParams(temperature=0.0, logprobs=2)] * 3
    out = rs.RejectionSampler()(logits.clone(), _metadata(params), [[0, 2]])
    assert out.token_ids == [[0, 2, 0]]
    assert out.logprobs_tensors is not None
    lists = out.logprobs_tensors.tolists()
    assert [ids[0] for ids in lists.logprob_token_ids] == [0, 2, 0]
    expected = torch.log(_target())[[0, 1, 2], [0, 2, 0]].tolist()
    assert torch.allclose(torch.tensor([v[0] for v in lists.logprobs]), torch.tensor(expected), atol=1e-5)
