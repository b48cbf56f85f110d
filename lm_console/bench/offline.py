"""Offline runs through engine.LLM (used by `bench throughput` and `bench prefix`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from lm_console.bench.datasets import BenchRequest


@dataclass
class OfflineEngine:
    """An engine.LLM plus what the benchmarks need to know about it."""

    llm: Any
    model_dir: str
    dtype: str
    vocab_size: int
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, model: str | None, engine_args: dict[str, Any]) -> OfflineEngine:
        from lm_console.engine import LLM

        llm = LLM(model, **engine_args)
        model_config = llm.config.model_config
        return cls(llm, model_config.model_dir, model_config.dtype, len(llm.get_tokenizer()))

    def warm_up(self, num_requests: int = 2) -> None:
        """A few short requests so one-time costs stay out of the timing."""
        from lm_console.engine import SamplingParams

        prompts = [{"prompt_token_ids": list(range(100 + i, 132 + i))} for i in range(num_requests)]
        self.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        self.llm.reset_prefix_cache()

    def run(self, requests: list[BenchRequest], use_tqdm: bool = True) -> dict[str, Any]:
        """Generate exactly output_len tokens per request; vLLM's throughput keys plus counts."""
        from lm_console.engine import SamplingParams

        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        params = [SamplingParams(temperature=1.0, top_p=1.0, seed=i, max_tokens=r.output_len, ignore_eos=True)
                  for i, r in enumerate(requests)]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=use_tqdm)
        elapsed = time.perf_counter() - start
        num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
        num_prompt = sum(r.prompt_len for r in requests)
        num_failed = sum(1 for o, r in zip(outputs, requests) if len(o.outputs[0].token_ids) != r.output_len)
        num_cached = sum(o.num_cached_tokens for o in outputs)
        return {
            "elapsed_time": elapsed,
            "num_requests": len(requests),
            "total_num_tokens": num_prompt + num_output,
            "requests_per_second": len(requests) / elapsed,
            "tokens_per_second": (num_prompt + num_output) / elapsed,
            "total_num_prompt_tokens": num_prompt,
            "total_num_output_tokens": num_output,
            "output_tokens_per_second": num_output / elapsed,
            "num_cached_tokens": num_cached,
            "failed": num_failed,
        }

    def shutdown(self) -> None:
        self.llm.shutdown()


def throughput_lines(result: dict[str, Any]) -> list[str]:
    """vLLM `bench throughput`'s summary lines."""
    return [
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s",
        f"Total num prompt tokens:  {result['total_num_prompt_tokens']}",
        f"Total num output tokens:  {result['total_num_output_tokens']}",
    ]
