"""LogprobsProcessor: Sampler logprobs -> per-token {token_id: Logprob} dicts."""

from __future__ import annotations

import math
from typing import Any

import torch

from lm_console.engine.frontend.logprobs import Logprob, LogprobsProcessor
from lm_console.engine.protocol import LogprobsLists
from lm_console.engine.sample.metadata import SamplingMetadata
from lm_console.engine.sample.sampler import Sampler
from lm_console.engine.sampling_params import SamplingParams


def _sample_steps(params: SamplingParams, vocab_size: int, num_steps: int
                  ) -> tuple[list[torch.Tensor], list[LogprobsLists]]:
    """Run the Sampler for one request; return each step's raw logits and LogprobsLists."""
    gen = torch.Generator().manual_seed(0)
    sampler, outputs = Sampler(), []
    all_logits, all_lists = [], []
    for _ in range(num_steps):
        logits = torch.randn(1, vocab_size, generator=gen) * 3
        metadata = SamplingMetadata.from_params([params], [outputs], [[1, 2]], {}, vocab_size,
                                                "cpu")
        out = sampler(logits.clone(), metadata)
        assert out.logprobs_tensors is not None
        outputs.append(int(out.sampled_token_ids[0]))
        all_logits.append(logits[0])
        all_lists.append(out.logprobs_tensors.tolists())
    return all_logits, all_lists


def test_dicts_hold_sampled_token_and_top_k(smollm2_tokenizer: Any) -> None:
    vocab_size = len(smollm2_tokenizer)
    params = SamplingParams(temperature=1.0, logprobs=4)
    processor = LogprobsProcessor.from_new_request(smollm2_tokenizer, params)
    assert processor.logprobs == [] and processor.cumulative_logprob == 0.0
    all_logits, all_lists = _sample_steps(params, vocab_size, 5)
    expected_cumulative = 0.0
    for logits, lists in zip(all_logits, all_lists):
        processor.update_from_output(lists)
        raw = logits.log_softmax(0)
        sampled = lists.logprob_token_ids[0][0]
        entry = processor.logprobs[-1]  # type: ignore[index]
        assert next(iter(entry)) == sampled
        assert entry[sampled].logprob == lists.logprobs[0][0]
        assert math.isclose(entry[sampled].logprob, float(raw[sampled]), rel_tol=1e-5)
        assert entry[sampled].rank == int((raw > raw[sampled]).sum()) + 1
        top = raw.topk(4)
        for rank, (value, token_id) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
            assert math.isclose(entry[token_id].logprob, value, rel_tol=1e-5)
            if token_id != sampled:
                assert entry[token_id].rank == rank
            assert entry[token_id].decoded_token == smollm2_tokenizer.decode([token_id])
        assert len(entry) in (4, 5)
        expected_cumulative += lists.logprobs[0][0]
    assert len(processor.logprobs) == 5  # type: ignore[arg-type]
    assert math.isclose(processor.cumulative_logprob, expected_cumulative)  # type: ignore[arg-type]
    assert processor.new_logprobs(2) == processor.logprobs[-2:]  # type: ignore[index]


def test_no_logprobs_requested() -> None:
    processor = LogprobsProcessor.from_new_request(None, SamplingParams())
    processor.update_from_output(LogprobsLists([[3]], [[-0.5]], [1]))
    assert processor.logprobs is None and processor.cumulative_logprob is None
    assert processor.new_logprobs(1) is None


def test_zero_logprobs_keeps_only_the_sampled_token() -> None:
    processor = LogprobsProcessor.from_new_request(None, SamplingParams(logprobs=0))
    # The batch asked for 2 (another request), this one for 0: extra columns are dropped.
    processor.update_from_output(LogprobsLists([[7, 1, 7]], [[-2.0, -0.1, -2.0]], [3]))
    assert processor.logprobs == [{7: Logprob(-2.0, 3, None)}]
    assert processor.cumulative_logprob == -2.0


def test_prompt_logprobs_start_with_none() -> None:
    processor = LogprobsProcessor.from_new_request(None, SamplingParams(prompt_logprobs=1))
    processor.update_prompt_logprobs(LogprobsLists([[5, 5], [6, 2]], [[-0.1, -0.1], [-3.0, -0.2]],
                                                   [1, 4]))
    assert processor.pop_prompt_logprobs() == [
        None, {5: Logprob(-0.1, 1, None)}, {6: Logprob(-3.0, 4, None), 2: Logprob(-0.2, 1, None)}]
    assert processor.pop_prompt_logprobs() == []
    processor.update_prompt_logprobs(LogprobsLists([[8, 8]], [[-0.3, -0.3]], [1]))  # next chunk
    assert processor.pop_prompt_logprobs() == [{8: Logprob(-0.3, 1, None)}]
