"""The cost of fp32 logits: LogitsProjection (each row's contenders recomputed in fp32) against
the bf16 head rounded to bf16, on the bf16 embedded model in one process, runs alternating.

    python benchmarks/logits_projection.py [NUM_REQUESTS]

Prints each run's output tokens per second and the ratio of the best runs.
"""
from __future__ import annotations

import random
import sys
import time

from lm_console.engine import LLM, SamplingParams
from lm_console.engine.models import layers

ORIGINAL = layers.LogitsProjection.__call__


def rounded(self, hidden, head):  # noqa: ANN001, ANN201 - the old path: bf16 output, then fp32
    return head(hidden).float()


def run(llm, prompts, params) -> float:  # noqa: ANN001
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    rng = random.Random(0)
    llm = LLM(None, dtype="bfloat16", multiprocess=False, max_model_len=1024)
    vocab = llm.config.model_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(rng.randint(32, 256))]}
               for _ in range(n)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(32, 128)) for _ in range(n)]
    run(llm, prompts[:4], params[:4])  # warm-up
    figures = {"fp32": [], "bf16-rounded": []}
    for order in (("fp32", "bf16-rounded"), ("bf16-rounded", "fp32")):
        for name in order:
            layers.LogitsProjection.__call__ = ORIGINAL if name == "fp32" else rounded
            llm.reset_prefix_cache()
            figures[name].append(run(llm, prompts, params))
    for name, values in figures.items():
        print(f"{name}: " + ", ".join(f"{v:.1f}" for v in values) + " output tok/s")
    print(f"ratio fp32 / bf16-rounded (best of 2): {max(figures['fp32']) / max(figures['bf16-rounded']):.3f}")
    llm.shutdown()


if __name__ == "__main__":
    main()
