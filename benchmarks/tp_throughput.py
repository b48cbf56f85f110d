"""Tensor parallelism: offline output tok/s at each --tp size, same workload, same run.

The workload of benchmarks/mp_throughput.py (random-token prompts, ignore_eos), scaled down by
default. Every TP size > 1 runs over the MultiprocExecutor (one worker process per rank, gloo
on CPU); TP=1 runs over it too (--tp1-backend mp, the default) so the ratio isolates the split
itself, or in-process (--tp1-backend uni). Prints tok/s per size and the ratio to the first.

    PYTHONPATH=$PWD python benchmarks/tp_throughput.py [--model PATH] [--tp 1 3] [--num-requests 16]
        [--num-threads N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mp_throughput import make_workload


def run(model: str | None, tp: int, backend: str, workload, args) -> float:
    from lm_console.engine import LLM, SamplingParams

    llm = LLM(model, dtype=args.dtype, tensor_parallel_size=tp, distributed_executor_backend=backend,
              max_num_seqs=args.max_num_seqs, kv_cache_memory=1 << 28, num_threads=args.num_threads)
    try:
        prompts = [{"prompt_token_ids": p} for p, _ in workload]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--tp1-backend", default="mp", choices=["mp", "uni"])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads per rank (default: cores // tp)")
    args = parser.parse_args()
    vocab_size = 49152
    if args.model:
        vocab_size = json.loads((Path(args.model) / "config.json").read_text()).get("vocab_size", vocab_size)
    workload = make_workload(args.num_requests, vocab_size, (32, 256), (32, 64), seed=0)
    results = []
    for tp in args.tp:
        backend = args.tp1_backend if tp == 1 else "mp"
        tok_s = run(args.model, tp, backend, workload, args)
        results.append(tok_s)
        print(f"TP={tp} ({backend}): {tok_s:8.1f} output tok/s  ({tok_s / results[0]:.2f}x TP={args.tp[0]})", flush=True)


if __name__ == "__main__":
    main()
