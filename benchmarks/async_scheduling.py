"""Async vs sync scheduling: offline throughput of one workload, both engines in the same run.

The workload of benchmarks/mp_throughput.py (random-token prompts, ignore_eos, uniform lengths)
through LLM() with async_scheduling off, then on (the order alternates with --repeat); prints
output tok/s of each, the ratio, and whether the greedy outputs are identical.

    python benchmarks/async_scheduling.py [--num-requests 32] [--model PATH] [--dtype float32]
        [--prompt-range 32,256] [--output-range 32,128] [--repeat 1] [--in-process]
"""

from __future__ import annotations

import argparse
import json

from mp_throughput import make_workload, timed_generate  # type: ignore[import-not-found]


def run(model: str | None, workload, async_scheduling: bool, args) -> dict:  # noqa: ANN001
    from lm_console.engine import LLM

    llm = LLM(model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, async_scheduling=async_scheduling,
              max_num_batched_tokens=args.max_num_batched_tokens, multiprocess=not args.in_process)
    result = timed_generate(llm, workload)
    stats = llm.get_stats()
    llm.shutdown()
    return {"async_scheduling": async_scheduling, **result, "num_steps": stats.num_steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-range", default="32,256")
    parser.add_argument("--output-range", default="32,128")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1, help="pairs of runs (order alternates)")
    parser.add_argument("--in-process", action="store_true", help="engine core in this process")
    parser.add_argument("--save-result", default=None)
    args = parser.parse_args()

    from transformers import AutoConfig

    from lm_console.engine.models.embedded import resolve_model_path

    vocab = AutoConfig.from_pretrained(resolve_model_path(args.model)).vocab_size
    workload = make_workload(args.num_requests, vocab, tuple(map(int, args.prompt_range.split(","))),
                             tuple(map(int, args.output_range.split(","))), args.seed)
    results = []
    for i in range(args.repeat):
        for async_scheduling in ((False, True) if i % 2 == 0 else (True, False)):
            result = run(args.model, workload, async_scheduling, args)
            results.append(result)
            print(f"async_scheduling={async_scheduling!s:5}  {result['output_tok_s']:8.1f} output tok/s  "
                  f"({result['output_tokens']} tokens in {result['elapsed_s']:.2f} s, {result['num_steps']} steps)")
    sync = [r for r in results if not r["async_scheduling"]]
    async_ = [r for r in results if r["async_scheduling"]]
    best_sync = max(r["output_tok_s"] for r in sync)
    best_async = max(r["output_tok_s"] for r in async_)
    same = sum(a == b for a, b in zip(sync[0]["token_ids"], async_[0]["token_ids"]))
    print(f"async / sync (best of each): {best_async / best_sync:.3f}x; "
          f"identical greedy outputs: {same}/{len(workload)}")
    if args.save_result:
        for r in results:
            r.pop("token_ids")
        with open(args.save_result, "w") as f:
            json.dump({"results": results, "ratio": best_async / best_sync, "identical": same}, f, indent=2)


if __name__ == "__main__":
    main()
