"""Sampler: greedy, temperature / top-k / top-p / min-p support, penalties, seeds, logprobs."""

from __future__ import annotations

from typing import Any, Callable

import torch

from lm_console.engine.sample import ops
from lm_console.engine.sample.metadata import SamplingMetadata
from lm_console.engine.sample.sampler import Sampler, SamplerOutput
from lm_console.engine.sampling_params import SamplingParams

MakeMetadata = Callable[..., SamplingMetadata]  # the make_metadata fixture (conftest.py)


def _sample(make_metadata: MakeMetadata, logits: torch.Tensor, params_list: list[SamplingParams],
            **kwargs: Any) -> SamplerOutput:
    metadata = make_metadata(params_list, logits.shape[1], **kwargs)
    return Sampler()(logits.clone(), metadata)


def _repeat(logits_row: torch.Tensor, num_rows: int) -> torch.Tensor:
    return logits_row.unsqueeze(0).repeat(num_rows, 1)  # [num_rows, V]


# -- greedy ------------------------------------------------------------------------------------

def test_greedy_equals_argmax_with_ties(make_metadata: MakeMetadata) -> None:
    torch.manual_seed(0)
    logits = torch.randint(0, 3, (64, 16)).float()  # many ties
    out = _sample(make_metadata, logits, [SamplingParams(temperature=0.0)] * 64)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=1))
    first_max = [(row == row.max()).nonzero()[0].item() for row in logits]
    assert out.sampled_token_ids.tolist() == first_max
    assert out.logprobs_tensors is None


def test_greedy_rows_in_a_mixed_batch_stay_argmax(make_metadata: MakeMetadata) -> None:
    torch.manual_seed(1)
    logits = torch.randn(32, 100)
    params = [SamplingParams(temperature=0.0 if row % 2 else 1.5, top_k=3 if row % 4 == 1 else -1)
              for row in range(32)]
    out = _sample(make_metadata, logits, params)
    greedy_rows = torch.arange(1, 32, 2)
    assert torch.equal(out.sampled_token_ids[greedy_rows], logits[greedy_rows].argmax(dim=1))


def test_metadata_skips_unneeded_tensors(make_metadata: MakeMetadata) -> None:
    greedy = make_metadata([SamplingParams(temperature=0.0, top_k=5, top_p=0.5)] * 3, 50)
    assert greedy.all_greedy and not greedy.all_random and greedy.temperature is None
    assert greedy.top_k is None and greedy.top_p is None and greedy.min_p is None
    assert greedy.no_penalties and greedy.prompt_token_ids is None and not greedy.min_tokens
    mixed = make_metadata([SamplingParams(temperature=0.0), SamplingParams(top_k=100),
                           SamplingParams(frequency_penalty=0.5)], 50)
    assert not mixed.all_greedy and not mixed.all_random
    assert mixed.top_k is None  # top_k >= vocab_size is no top-k
    assert not mixed.no_penalties and mixed.prompt_token_ids is None  # only repetition needs it
    rep = make_metadata([SamplingParams(repetition_penalty=1.1), SamplingParams()], 50,
                        prompts=[[1, 2, 3], [4]])
    assert rep.prompt_token_ids is not None
    assert rep.prompt_token_ids.tolist() == [[1, 2, 3], [4, 50, 50]]


# -- support of temperature / top-k / top-p / min-p --------------------------------------------

def test_top_k_restricts_support(make_metadata: MakeMetadata) -> None:
    torch.manual_seed(2)
    row = torch.randn(40)
    out = _sample(make_metadata, _repeat(row, 4000), [SamplingParams(temperature=2.0, top_k=5)] * 4000)
    allowed = set(row.topk(5).indices.tolist())
    sampled = set(out.sampled_token_ids.tolist())
    assert sampled <= allowed and len(sampled) == 5


def _nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    order = probs.double().argsort(descending=True)
    mass_before = probs.double()[order].cumsum(0) - probs.double()[order]
    return set(order[mass_before < top_p].tolist())


def test_top_p_restricts_support(make_metadata: MakeMetadata) -> None:
    torch.manual_seed(3)
    row = torch.randn(30) * 2
    temperature, top_p = 0.8, 0.7
    out = _sample(make_metadata, _repeat(row, 4000),
                  [SamplingParams(temperature=temperature, top_p=top_p)] * 4000)
    allowed = _nucleus((row / temperature).softmax(0), top_p)
    sampled = set(out.sampled_token_ids.tolist())
    assert sampled <= allowed and len(sampled) >= len(allowed) - 1


def test_min_p_restricts_support(make_metadata: MakeMetadata) -> None:
    torch.manual_seed(4)
    row = torch.randn(30) * 2
    temperature, min_p = 1.3, 0.2
    out = _sample(make_metadata, _repeat(row, 4000),
                  [SamplingParams(temperature=temperature, min_p=min_p)] * 4000)
    probs = (row / temperature).softmax(0)
    allowed = set((probs >= min_p * probs.max()).nonzero().squeeze(1).tolist())
    assert set(out.sampled_token_ids.tolist()) <= allowed


def test_temperature_sharpens_and_flattens(make_metadata: MakeMetadata) -> None:
    row = torch.tensor([0.0, 1.0, 2.0, 3.0])
    cold = _sample(make_metadata, _repeat(row, 2000), [SamplingParams(temperature=0.05)] * 2000)
    hot = _sample(make_metadata, _repeat(row, 2000), [SamplingParams(temperature=100.0)] * 2000)
    assert (cold.sampled_token_ids == 3).all()
    assert len(set(hot.sampled_token_ids.tolist())) == 4


def test_exponential_race_follows_the_distribution(make_metadata: MakeMetadata) -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    num_rows = 40000
    out = _sample(make_metadata, _repeat(probs.log(), num_rows), [SamplingParams()] * num_rows)
    freq = torch.bincount(out.sampled_token_ids, minlength=4).double() / num_rows
    assert torch.allclose(freq, probs.double(), atol=0.015)


def _reference_keep(row: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, int]:
    """(kept mask in float64, how many tokens sit so near the top-p boundary that float32
    rounding may legitimately move them across)."""
    x = row.double()
    keep = torch.ones_like(x, dtype=torch.bool)
    if top_k < x.numel():
        keep &= x >= x.topk(top_k).values[-1]
    slack = 0
    if top_p < 1.0:
        masked = x.masked_fill(~keep, float("-inf"))
        values = masked.sort(descending=True).values
        probs = values.softmax(0)
        mass_before = probs.cumsum(0) - probs
        num_keep = int((mass_before < top_p).sum())
        keep &= x >= values[num_keep - 1]
        slack = int(((mass_before - top_p).abs() < 1e-4).sum())
    return keep, slack


def test_top_k_top_p_match_a_sort_reference_on_a_real_vocab() -> None:
    torch.manual_seed(5)
    vocab_size, num_rows = 49152, 12
    # Peaked rows have a small nucleus (topk candidates); flat rows force the sort fallback.
    scale = torch.tensor([6.0, 2.0, 6.0, 2.0, 0.1, 0.1, 6.0, 0.1, 2.0, 0.1, 3.0, 3.0])
    logits = torch.randn(num_rows, vocab_size) * scale.unsqueeze(1)
    top_k = torch.tensor([vocab_size, 50, vocab_size, 7, vocab_size, 2000, 1, vocab_size,
                          vocab_size, 30, 400, vocab_size])
    top_p = torch.tensor([0.9, 0.8, 1.0, 0.5, 0.9, 0.95, 0.3, 1.0, 0.99, 1.0, 0.6, 0.2])
    out = logits.clone()
    ops.apply_top_k_top_p(out, top_k, top_p)
    for row in range(num_rows):
        expected, slack = _reference_keep(logits[row], int(top_k[row]), float(top_p[row]))
        assert int((torch.isfinite(out[row]) ^ expected).sum()) <= slack, row


def test_top_k_only_uses_per_row_k() -> None:
    torch.manual_seed(6)
    logits = torch.randn(4, 1000)
    top_k = torch.tensor([1, 10, 1000, 999])
    out = logits.clone()
    ops.apply_top_k_top_p(out, top_k, None)
    assert torch.isfinite(out).sum(dim=1).tolist() == [1, 10, 1000, 999]


# -- penalties -----------------------------------------------------------------------------

def test_penalties_match_hand_computed_values(make_metadata: MakeMetadata) -> None:
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, -0.5, 3.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    metadata = make_metadata([params], 6, outputs=[[1, 2, 2, 5]], prompts=[[0, 1]])
    ops.apply_penalties(logits, metadata)
    # seen {0, 1, 2, 5}: positive / 2, negative * 2; then - 0.5 * count - 0.25 for output ids
    expected = torch.tensor([[0.5, -2.75, -0.25, 0.5, -0.5, 0.75]])
    assert torch.allclose(logits, expected)


def _reference_penalties(logits: torch.Tensor, params_list: list[SamplingParams],
                         outputs: list[list[int]], prompts: list[list[int]]) -> torch.Tensor:
    expected = logits.clone()
    for row, params in enumerate(params_list):
        for token in set(prompts[row]) | set(outputs[row]):
            value = expected[row, token]
            penalty = params.repetition_penalty
            expected[row, token] = value / penalty if value > 0 else value * penalty
        for token in set(outputs[row]):
            expected[row, token] -= params.frequency_penalty * outputs[row].count(token)
            expected[row, token] -= params.presence_penalty
    return expected


def test_penalties_match_a_reference_across_rows(make_metadata: MakeMetadata) -> None:
    gen = torch.Generator().manual_seed(7)
    vocab_size, num_rows = 50, 6
    logits = torch.randn(num_rows, vocab_size, generator=gen)
    params_list = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(),  # no penalties in a batch that has some
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=1.5),
        SamplingParams(repetition_penalty=1.5, presence_penalty=0.3),
        SamplingParams(repetition_penalty=2.0, frequency_penalty=2.0),
    ]
    outputs = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in (5, 9, 3, 0, 12, 1)]
    prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in (4, 1, 7, 6, 2, 9)]
    metadata = make_metadata(params_list, vocab_size, outputs=outputs, prompts=prompts)
    out = logits.clone()
    ops.apply_penalties(out, metadata)
    assert torch.allclose(out, _reference_penalties(logits, params_list, outputs, prompts), atol=1e-6)


def test_penalties_apply_before_greedy(make_metadata: MakeMetadata) -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    out = _sample(make_metadata, logits, params, outputs=[[0]], prompts=[[2]])
    assert out.sampled_token_ids.tolist() == [1]


# -- min_tokens ----------------------------------------------------------------------------

def test_min_tokens_masks_stop_tokens_until_reached(make_metadata: MakeMetadata) -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0, 0.5]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3, 4])
    output: list[int] = []
    metadata = make_metadata([params], 6, outputs=[output])  # the live list, reused per step
    sampler = Sampler()
    assert sampler(logits.clone(), metadata).sampled_token_ids.tolist() == [2]
    output.append(2)
    assert sampler(logits.clone(), metadata).sampled_token_ids.tolist() == [2]
    output.append(2)
    assert sampler(logits.clone(), metadata).sampled_token_ids.tolist() == [3]


# -- seeds -----------------------------------------------------------------------------------

def _seeded_run(make_metadata: MakeMetadata, num_rows: int, target_row: int,
                steps: list[torch.Tensor]) -> list[int]:
    """Sample the seeded target request for len(steps) steps inside a batch of num_rows."""
    target = SamplingParams(temperature=1.0, seed=1234, top_k=500)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9),
              SamplingParams(temperature=1.1, seed=99), SamplingParams(temperature=0.7, top_p=0.8)]
    params_list = [others[row % len(others)] for row in range(num_rows)]
    params_list[target_row] = target
    metadata = make_metadata(params_list, steps[0].numel())
    sampler, tokens = Sampler(), []
    noise = torch.Generator().manual_seed(num_rows)
    for step_logits in steps:
        logits = torch.randn(num_rows, step_logits.numel(), generator=noise)
        logits[target_row] = step_logits
        tokens.append(int(sampler(logits, metadata).sampled_token_ids[target_row]))
    return tokens


def test_seeded_request_reproduces_across_runs_and_batches(make_metadata: MakeMetadata) -> None:
    gen = torch.Generator().manual_seed(8)
    steps = [torch.randn(2000, generator=gen) * 0.5 for _ in range(6)]
    alone = _seeded_run(make_metadata, 1, 0, steps)
    assert alone == _seeded_run(make_metadata, 1, 0, steps)
    assert alone == _seeded_run(make_metadata, 8, 5, steps)
    assert alone == _seeded_run(make_metadata, 8, 2, steps)
    assert len(set(alone)) > 1  # it does sample


def test_unseeded_rows_vary(make_metadata: MakeMetadata) -> None:
    logits = torch.zeros(1, 1000)
    metadata = make_metadata([SamplingParams()], 1000)
    sampler = Sampler()
    tokens = {int(sampler(logits.clone(), metadata).sampled_token_ids[0]) for _ in range(30)}
    assert len(tokens) > 20


def test_different_seeds_differ(make_metadata: MakeMetadata) -> None:
    logits = torch.zeros(2, 1000)
    out = _sample(make_metadata, logits, [SamplingParams(seed=1), SamplingParams(seed=2)])
    again = _sample(make_metadata, logits, [SamplingParams(seed=1), SamplingParams(seed=2)])
    assert out.sampled_token_ids.tolist() == again.sampled_token_ids.tolist()
    assert out.sampled_token_ids[0] != out.sampled_token_ids[1]


# -- logprobs --------------------------------------------------------------------------------

def test_logprobs_are_raw_top_k_with_sampled_rank(make_metadata: MakeMetadata) -> None:
    torch.manual_seed(9)
    logits = torch.randn(6, 50)
    params_list = [SamplingParams(temperature=0.7, logprobs=3, repetition_penalty=1.5),
                   SamplingParams(temperature=0.0, logprobs=1),
                   SamplingParams(temperature=1.0),
                   SamplingParams(temperature=0.0, frequency_penalty=1.0),
                   SamplingParams(temperature=2.0, top_k=20, logprobs=0),
                   SamplingParams(temperature=1.0, min_p=0.1)]
    out = _sample(make_metadata, logits, params_list, outputs=[[1, 2]] * 6, prompts=[[3]] * 6)
    tensors = out.logprobs_tensors
    assert tensors is not None and tensors.logprob_token_ids.shape == (6, 4)
    raw = logits.log_softmax(dim=1)
    sampled = out.sampled_token_ids
    assert torch.equal(tensors.logprob_token_ids[:, 0], sampled)
    assert torch.allclose(tensors.logprobs[:, 0], raw.gather(1, sampled.unsqueeze(1)).squeeze(1))
    top = raw.topk(3, dim=1)
    assert torch.equal(tensors.logprob_token_ids[:, 1:], top.indices)
    assert torch.allclose(tensors.logprobs[:, 1:], top.values)
    for row in range(6):
        assert int(tensors.selected_token_ranks[row]) == int((raw[row] > raw[row, sampled[row]]).sum()) + 1
    lists = tensors.tolists()
    assert lists.logprob_token_ids[0][0] == int(sampled[0]) and len(lists.sampled_token_ranks) == 6


def test_from_params_reads_the_widest_logprobs(make_metadata: MakeMetadata) -> None:
    metadata: SamplingMetadata = make_metadata(
        [SamplingParams(logprobs=2), SamplingParams(), SamplingParams(logprobs=5)], 10)
    assert metadata.max_num_logprobs == 5
    assert make_metadata([SamplingParams()], 10).max_num_logprobs is None


# -- logit_bias and allowed_token_ids ----------------------------------------------------------

def test_logit_bias_moves_greedy_and_is_per_row(make_metadata: MakeMetadata) -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, 40)
    target = int(logits[0].argmin())  # the least likely token of row 0
    params = [SamplingParams(temperature=0.0, logit_bias={target: 100.0}),
              SamplingParams(temperature=0.0),  # negative control: the same logits, no bias
              SamplingParams(temperature=0.0, logit_bias={int(logits[2].argmax()): -100.0}),
              SamplingParams(temperature=0.0, logit_bias={"5": 0.5})]  # JSON's string key
    out = _sample(make_metadata, logits, params)
    assert out.sampled_token_ids[0].item() == target
    assert out.sampled_token_ids[1].item() == int(logits[1].argmax())
    assert out.sampled_token_ids[2].item() == int(logits[2].topk(2).indices[1])  # the runner-up
    expected = logits[3].clone()
    expected[5] += 0.5
    assert out.sampled_token_ids[3].item() == int(expected.argmax())


def test_logit_bias_applies_to_random_rows_too(make_metadata: MakeMetadata) -> None:
    logits = torch.zeros(8, 30)
    params = [SamplingParams(temperature=1.0, seed=row, logit_bias={7: 100.0}) for row in range(8)]
    out = _sample(make_metadata, logits, params)
    assert out.sampled_token_ids.tolist() == [7] * 8  # e^100 outweighs the other 29 tokens


def test_allowed_token_ids_restrict_only_their_row(make_metadata: MakeMetadata) -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, 50)
    allowed = [int(i) for i in logits[0].topk(50).indices[-3:]]  # the three least likely
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, seed=1, allowed_token_ids=[11, 12])]
    out = _sample(make_metadata, logits, params)
    assert out.sampled_token_ids[0].item() == max(allowed, key=lambda t: logits[0, t].item())
    assert out.sampled_token_ids[1].item() == int(logits[1].argmax())  # unrestricted
    assert out.sampled_token_ids[2].item() in (11, 12)
    seeded = [SamplingParams(temperature=1.0, seed=seed, allowed_token_ids=[11, 12]) for seed in range(20)]
    assert set(_sample(make_metadata, _repeat(logits[2], 20), seeded).sampled_token_ids.tolist()) <= {11, 12}


def test_logit_bias_and_allowed_ids_are_validated() -> None:
    import pytest

    from lm_console.engine.errors import InvalidSamplingParamsError

    for bad in ({3: 100.5}, {3: float("nan")}, {-1: 1.0}, {"x": 1.0}, {3: True}):
        with pytest.raises(InvalidSamplingParamsError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    for bad in ([], [-1], [1.5], [True]):
        with pytest.raises(InvalidSamplingParamsError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    assert SamplingParams(logit_bias={"12": -100, 3: 100.0}).logit_bias == {12: -100.0, 3: 100.0}
