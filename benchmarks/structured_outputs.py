"""Structured vs free decoding throughput on the same workload (goal: >= 0.85x).

B requests decode exactly T tokens each, at temperature 0.8 (seeded), once free (ignore_eos) and
once under a JSON schema that cannot complete within T tokens (an array of at least 100 objects
with integer, string and enum fields; no optional whitespace), so both runs sample the same
number of tokens and the structured one pays for the grammar in every step: filling B bitmask
rows (xgrammar matchers), masking the logits, and advancing each matcher. The runs alternate,
best of --repeats each, after one warm-up each (the warm-up also compiles the grammar). With
--threads 1 (the default) the engine runs in this process on one torch thread and the clock is
this process's CPU time, which other jobs on a shared machine barely disturb; --threads 0 uses
all cores and the wall clock.

    python benchmarks/structured_outputs.py [--model DIR] [--batch 16] [--tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

from lm_console.engine import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 100, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                       "name": {"type": "string", "maxLength": 8},
                       "kind": {"enum": ["alpha", "beta", "gamma"]}},
        "required": ["id", "name", "kind"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False,
}


CLOCK = time.process_time


def run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, int]:
    start = CLOCK()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = CLOCK() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: all cores, wall clock)")
    args = parser.parse_args()
    global CLOCK
    if args.threads != 1:
        CLOCK = time.perf_counter
    llm = LLM(args.model, max_model_len=512, multiprocess=False, num_threads=args.threads or None)
    prompts = [f"Write inventory record number {i} as JSON:" for i in range(args.batch)]
    free = SamplingParams(temperature=0.8, seed=0, max_tokens=args.tokens, ignore_eos=True)
    structured = SamplingParams(temperature=0.8, seed=0, max_tokens=args.tokens,
                                structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    start = time.perf_counter()
    run(llm, prompts[:1], structured)  # compile the grammar (and load the tokenizer) once
    print(f"first structured request (tokenizer + grammar compile + {args.tokens} tokens): "
          f"{time.perf_counter() - start:.2f} s wall")
    run(llm, prompts, free)  # warm-up
    best = {"free": float("inf"), "structured": float("inf")}
    for _ in range(args.repeats):
        for name, params in (("free", free), ("structured", structured)):
            elapsed, num_tokens = run(llm, prompts, params)
            assert num_tokens == args.batch * args.tokens, (name, num_tokens)
            best[name] = min(best[name], elapsed)
    num_tokens = args.batch * args.tokens
    free_tps, structured_tps = num_tokens / best["free"], num_tokens / best["structured"]
    clock = "process CPU time, 1 torch thread" if CLOCK is time.process_time else "wall clock"
    print(f"{args.batch} requests x {args.tokens} tokens, best of {args.repeats} ({clock}):")
    print(f"  free        {free_tps:8.1f} tokens/s")
    print(f"  structured  {structured_tps:8.1f} tokens/s")
    print(f"  ratio       {structured_tps / free_tps:8.3f}x (goal >= 0.85x)")
    llm.shutdown()


if __name__ == "__main__":
    main()
