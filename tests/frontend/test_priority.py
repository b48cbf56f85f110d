"""Priority through LLM / AsyncLLM: the argument reaches the scheduler, fcfs refuses it (as vLLM)."""

from __future__ import annotations

import asyncio

import pytest

from lm_console.engine import LLM, AsyncLLM, SamplingParams
from lm_console.engine.errors import InvalidEngineArgsError, InvalidPriorityError

pytestmark = pytest.mark.slow


def test_priority_orders_admission_and_outputs_are_unchanged(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, max_num_seqs=1,
              scheduling_policy="priority", multiprocess=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        prompts = [{"prompt_token_ids": [10 + i] * (5 + i)} for i in range(4)]
        outputs = llm.generate(prompts, params, use_tqdm=False, priority=[3, -1, 2, 0])
        # One seat: each runs alone, in priority order (-1, 0, 2, 3).
        order = sorted(range(4), key=lambda i: outputs[i].metrics.first_scheduled_time)
        assert order == [1, 3, 2, 0]
        plain = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
        with pytest.raises(InvalidPriorityError, match="one int per prompt"):
            llm.generate(prompts, params, use_tqdm=False, priority=[1])
        with pytest.raises(InvalidPriorityError, match="must be an int"):
            llm.generate(prompts[0], params, use_tqdm=False, priority=[1.5])
    finally:
        llm.shutdown()


def test_fcfs_refuses_a_priority(tiny_llama_dir) -> None:
    async def main() -> None:
        async with AsyncLLM(str(tiny_llama_dir), dtype="float32", max_model_len=64,
                            stat_loggers=[]) as llm:
            with pytest.raises(InvalidPriorityError, match="scheduling_policy='priority'"):
                async for _ in llm.generate("hi", SamplingParams(max_tokens=1), priority=2):
                    pass
            outputs = [o async for o in llm.generate("hi", SamplingParams(max_tokens=1), priority=0)]
            assert outputs[-1].finished

    asyncio.run(main())
    with pytest.raises(InvalidEngineArgsError, match="scheduling_policy"):
        LLM(str(tiny_llama_dir), scheduling_policy="lifo")
