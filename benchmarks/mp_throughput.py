"""Multiprocess engine core vs in-process, and a serving-style AsyncLLM run, in one script.

Part 1 (offline): the engine-core workload of benchmarks/throughput.py (64 requests, prompts
of 32-512 random tokens, outputs of 32-256 tokens, ignore_eos) through LLM(multiprocess=False) and LLM() (SyncMPClient), same run, same
settings; prints output tok/s of each and the ratio (goal >= 0.95x).
Part 2 (serving): AsyncLLM with requests arriving as a Poisson process (--request-rate, inf =
all at once) under --max-concurrency; measures, at the client, TTFT, TPOT, ITL and E2EL
(mean, median, p99, in ms), like vLLM's benchmark_serving.

    python benchmarks/mp_throughput.py [--num-requests 64] [--serving-requests 64]
        [--request-rate inf] [--max-concurrency 32] [--model PATH] [--skip-offline|--skip-serving]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path


def make_workload(num_requests: int, vocab_size: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], seed: int) -> list[tuple[list[int], int]]:
    """benchmarks/throughput.py's workload: random-token prompts (ids >= 100), uniform lengths."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab_size) for _ in range(rng.randint(*prompt_range))],
         rng.randint(*output_range))
        for _ in range(num_requests)
    ]


def run_offline(model: str | None, workload, multiprocess: bool, args) -> dict:
    from lm_console.engine import LLM

    llm = LLM(model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, multiprocess=multiprocess)
    result = timed_generate(llm, workload)
    llm.shutdown()
    name = "multiprocess (SyncMPClient)" if multiprocess else "in-process (InprocClient)"
    return {"system": name, **result}


def timed_generate(llm, workload) -> dict:  # noqa: ANN001
    """Warm up, then time `workload` (greedy, exactly n tokens each) on `llm`: elapsed, output
    tokens and tok/s, and the token ids (for comparing systems)."""
    from lm_console.engine import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids, _ in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()  # the warm-up prompts must not be prefix hits
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_output == sum(n for _, n in workload), "wrong token count"
    return {"elapsed_s": elapsed, "output_tokens": num_output, "output_tok_s": num_output / elapsed,
            "token_ids": [o.outputs[0].token_ids for o in outputs]}


async def run_serving(model: str | None, workload, args) -> dict:
    from lm_console.engine import AsyncLLM, RequestOutputKind, SamplingParams

    rng = random.Random(args.seed)
    semaphore = asyncio.Semaphore(args.max_concurrency)
    records: list[dict] = []

    async def one(i: int, ids: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        async with semaphore:
            start = time.perf_counter()
            times: list[float] = []
            num_tokens = 0
            async for out in llm.generate({"prompt_token_ids": ids}, params, f"serve-{i}"):
                times.append(time.perf_counter())
                num_tokens += len(out.outputs[0].token_ids)
        records.append({"start": start, "times": times, "num_tokens": num_tokens})

    async with AsyncLLM(model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, stat_loggers=[]) as llm:
        async for _ in llm.generate({"prompt_token_ids": workload[0][0]},
                                    SamplingParams(max_tokens=4, ignore_eos=True)):
            pass  # warm-up
        await llm.reset_prefix_cache()
        tasks = []
        bench_start = time.perf_counter()
        for i, (ids, max_tokens) in enumerate(workload):
            tasks.append(asyncio.create_task(one(i, ids, max_tokens)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - bench_start
    ttft = [r["times"][0] - r["start"] for r in records]
    e2el = [r["times"][-1] - r["start"] for r in records]
    tpot = [(r["times"][-1] - r["times"][0]) / (r["num_tokens"] - 1) for r in records if r["num_tokens"] > 1]
    itl = [b - a for r in records for a, b in zip(r["times"], r["times"][1:])]
    num_tokens = sum(r["num_tokens"] for r in records)
    return {"duration_s": duration, "requests": len(records), "output_tokens": num_tokens,
            "request_throughput": len(records) / duration, "output_tok_s": num_tokens / duration,
            **{name: _summary(values) for name, values in
               (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2el_ms", e2el))}}


def _summary(values: list[float]) -> dict:
    ordered = sorted(v * 1000 for v in values)
    p99 = ordered[min(len(ordered) - 1, max(0, round(0.99 * len(ordered)) - 1))] if ordered else 0.0
    return {"mean": statistics.fmean(ordered) if ordered else 0.0,
            "median": statistics.median(ordered) if ordered else 0.0, "p99": p99}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path or name (default: the embedded model)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-range", default="32,512")
    parser.add_argument("--output-range", default="32,256")
    parser.add_argument("--serving-requests", type=int, default=None, help="default: --num-requests")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=1, help="offline runs of each mode (best counts)")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--save-result", default=None, help="write all figures as JSON")
    args = parser.parse_args()

    from transformers import AutoConfig

    from lm_console.engine.models.embedded import resolve_model_path

    vocab_size = AutoConfig.from_pretrained(resolve_model_path(args.model)).vocab_size
    prompt_range = tuple(map(int, args.prompt_range.split(",")))
    output_range = tuple(map(int, args.output_range.split(",")))
    results: dict = {}
    if not args.skip_offline:
        workload = make_workload(args.num_requests, vocab_size, prompt_range, output_range, args.seed)
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.repeats):  # interleaved, best of each: a shared machine is noisy
            for multiprocess in (False, True):
                runs[multiprocess].append(run_offline(args.model, workload, multiprocess, args))
        inproc, mp = (max(runs[m], key=lambda r: r["output_tok_s"]) for m in (False, True))
        token_ids = [r.pop("token_ids") for r in runs[False] + runs[True]]
        assert all(ids == token_ids[0] for ids in token_ids), "multiprocess outputs differ from in-process"
        ratio = mp["output_tok_s"] / inproc["output_tok_s"]
        results["offline"] = {"in_process": inproc, "multiprocess": mp, "ratio": ratio}
        print("\n| engine core | output tokens | seconds | output tok/s |\n|---|---|---|---|")
        for r in (inproc, mp):
            print(f"| {r['system']} | {r['output_tokens']} | {r['elapsed_s']:.1f} | {r['output_tok_s']:.1f} |")
        print(f"\nmultiprocess / in-process: {ratio:.3f}x (goal >= 0.95x; outputs identical)")
    if not args.skip_serving:
        workload = make_workload(args.serving_requests or args.num_requests, vocab_size, prompt_range,
                                 output_range, args.seed + 1)
        serving = asyncio.run(run_serving(args.model, workload, args))
        results["serving"] = serving
        print(f"\nAsyncLLM serving: {serving['requests']} requests, rate {args.request_rate}/s, "
              f"max concurrency {args.max_concurrency}: {serving['duration_s']:.1f} s, "
              f"{serving['request_throughput']:.2f} req/s, {serving['output_tok_s']:.1f} output tok/s")
        print("\n| metric (ms) | mean | median | p99 |\n|---|---|---|---|")
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            s = serving[name]
            print(f"| {name[:-3].upper()} | {s['mean']:.1f} | {s['median']:.1f} | {s['p99']:.1f} |")
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
