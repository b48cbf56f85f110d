"""Greedy outputs (fp32) with async_scheduling on equal those with it off, on the tiny Llama and
the embedded model: max_tokens, stop token ids, stop strings, EOS, n > 1, prefix hits, forced
preemption; no KV block leaks (the engine core in its own process, as by default)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from llm_helpers import assert_no_leaked_blocks, random_prompts, text_prompts


def _outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):  # noqa: ANN202
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs] for o in outputs]


# In-process cores keep the module cheap; the slow test below runs the core in its own process.
ENGINE = dict(dtype="float32", multiprocess=False)


@pytest.fixture(scope="module")
def llms(tiny_llama_dir):  # noqa: ANN201
    sync = LLM(str(tiny_llama_dir), **ENGINE)
    async_ = LLM(str(tiny_llama_dir), async_scheduling=True, **ENGINE)
    yield sync, async_
    for llm in (sync, async_):
        assert_no_leaked_blocks(llm)
        llm.shutdown()


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir) -> list[list[int]]:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_llama_dir).vocab_size
    return random_prompts(vocab, 8, 5, 100, seed=3)


FREE = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def free_outputs(llms, prompts):  # noqa: ANN001, ANN201
    """The sync engine's greedy outputs, no stop condition but max_tokens."""
    return _outputs(llms[0], prompts, FREE)


def test_async_config_reaches_the_core(llms) -> None:  # noqa: ANN001
    sync, async_ = llms
    assert async_.config.scheduler_config.async_scheduling
    assert not sync.config.scheduler_config.async_scheduling


def test_greedy_equal_with_every_stop_condition(llms, prompts, free_outputs) -> None:  # noqa: ANN001
    """max_tokens, stop token ids and stop strings that fire mid-output, EOS with min_tokens, logprobs."""
    sync, async_ = llms
    params = []
    for i, out in enumerate(free_outputs):
        tokens, text = out[0][0], out[0][3]
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=1 + i, ignore_eos=True, logprobs=2))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                         stop_token_ids=[tokens[3 + i % 5]]))
        elif kind == 2 and len(text) > 8:
            params.append(SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                         stop=[text[len(text) // 2: len(text) // 2 + 3]]))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=16, min_tokens=2))
    expected = _outputs(sync, prompts, params)
    assert _outputs(async_, prompts, params) == expected
    assert [o[0][1] for o in expected].count("stop") >= 3  # the stop conditions did fire


def test_n_greater_than_one_greedy_and_seeded(llms, prompts) -> None:  # noqa: ANN001
    sync, async_ = llms
    params = [SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(n=2, temperature=0.9, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)]
    expected = _outputs(sync, prompts[:2], params)
    assert _outputs(async_, prompts[:2], params) == expected
    assert [len(o) for o in expected] == [3, 2]


def test_prefix_hits_do_not_change_outputs(llms, prompts) -> None:  # noqa: ANN001
    sync, async_ = llms
    prefix = [t for p in prompts for t in p][:48]
    shared = [prefix + p[:10] for p in prompts[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = _outputs(sync, shared, params)
    assert _outputs(async_, shared, params) == expected
    # Again: every prompt now hits the prefix cache.
    again = async_.generate([{"prompt_token_ids": p} for p in shared], params, use_tqdm=False)
    assert [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs] for o in again] == expected
    assert all(o.num_cached_tokens >= 48 for o in again)


def test_forced_preemption_does_not_change_outputs(prompts, free_outputs, make_llm, tiny_llama_dir) -> None:  # noqa: ANN001
    # 12 usable blocks of 16 tokens for 8 requests of up to 116 tokens: preemptions.
    small = make_llm(str(tiny_llama_dir), async_scheduling=True, num_gpu_blocks_override=13, max_model_len=192,
                     **ENGINE)
    assert _outputs(small, prompts, FREE) == free_outputs
    assert small.get_stats().num_preemptions_total > 0


@pytest.mark.slow
def test_embedded_model_greedy_equal(embedded_model_dir, make_llm) -> None:  # noqa: ANN001
    # The async engine core runs in its own process here (the default), as under `lmc serve`.
    sync = make_llm(None, **ENGINE)
    prompts = text_prompts(sync.get_tokenizer(), 4, 5, 200)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    expected = _outputs(sync, prompts, params)
    async_ = make_llm(None, dtype="float32", async_scheduling=True)
    assert _outputs(async_, prompts, params) == expected
