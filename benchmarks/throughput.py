"""Offline throughput: this engine vs HF transformers `generate` on the same workload.

A thin wrapper over `lmc bench throughput --baseline hf` (lm_console/bench/) that keeps this
script's workload: 64 requests, prompts of 32-512 random tokens, outputs of 32-256 tokens,
ignore_eos; HF at batch 8/16/32 in fp32 and bf16; prints the ratio against HF's best.

    python benchmarks/throughput.py [--num-requests 64] [--hf-batch-sizes 8,16,32]
                                    [--hf-dtypes float32,bfloat16] [--engine-dtype auto]
                                    [--data-parallel-size N]  # N engine cores, --threads split among them
                                    [--async-scheduling]
"""

from __future__ import annotations

import argparse
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-range", default="32,512")
    parser.add_argument("--output-range", default="32,256")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engine-dtype", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--hf-batch-sizes", default="8,16,32")
    parser.add_argument("--hf-dtypes", default="float32,bfloat16")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--async-scheduling", action="store_true", help="the engine with async scheduling")
    parser.add_argument("--save-result", default=None, help="write all figures as JSON")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="engine cores (data parallelism); each gets --threads / N torch threads")
    args = parser.parse_args()

    import torch

    from lm_console.bench.runner import Baseline, Workload, bench_throughput

    torch.set_num_threads(args.threads)
    low_in, high_in = map(int, args.prompt_range.split(","))
    low_out, high_out = map(int, args.output_range.split(","))
    workload = Workload("random", args.num_requests, seed=args.seed, input_range=(low_in, high_in),
                        output_range=(low_out, high_out))
    baseline = Baseline("none" if args.skip_hf else "hf", tuple(map(int, args.hf_batch_sizes.split(","))),
                        tuple(args.hf_dtypes.split(",")))
    engine = {"dtype": args.engine_dtype, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens,
              "num_threads": max(args.threads // args.data_parallel_size, 1)}
    if args.async_scheduling:
        engine["async_scheduling"] = True
    if args.data_parallel_size > 1:
        engine["data_parallel_size"] = args.data_parallel_size
    sys.exit(1 if bench_throughput(None, engine, workload, baseline, args.save_result) else 0)


if __name__ == "__main__":
    main()
