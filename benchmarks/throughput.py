"""Offline throughput: this engine vs HF transformers `generate` on the same workload.

Workload (default): 64 requests, prompt lengths uniform in [32, 512] random tokens, output
lengths uniform in [32, 256], ignore_eos. HF runs `generate` with left padding at each batch
size and dtype given, and only the requested tokens count. Prints both figures and the ratio
against HF's best, all measured in this run.

    python benchmarks/throughput.py [--num-requests 64] [--hf-batch-sizes 8,16,32]
                                    [--hf-dtypes float32,bfloat16] [--engine-dtype auto]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch


def make_workload(num_requests: int, vocab_size: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    # Avoid the special tokens at the start of the vocabulary.
    return [
        ([rng.randrange(100, vocab_size) for _ in range(rng.randint(*prompt_range))],
         rng.randint(*output_range))
        for _ in range(num_requests)
    ]


def run_engine(workload, dtype: str, max_num_seqs: int, max_num_batched_tokens: int) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(dtype=dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    prompts = [{"prompt_token_ids": ids} for ids, _ in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_output == sum(n for _, n in workload), "the engine produced the wrong token count"
    return {"system": f"lm-console ({llm.config.dtype})", "elapsed_s": elapsed,
            "output_tokens": num_output, "output_tok_s": num_output / elapsed}


def run_hf(workload, model_dir: str, dtype: torch.dtype, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad_id = 0
    num_requested = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(workload), batch_size):
            batch = workload[i:i + batch_size]
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (ids, _) in enumerate(batch):
                input_ids[row, width - len(ids):] = torch.tensor(ids)
                attention_mask[row, width - len(ids):] = 1
            max_new = max(n for _, n in batch)
            model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                           max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad_id)
            num_requested += sum(n for _, n in batch)
    elapsed = time.perf_counter() - start
    return {"system": f"HF transformers ({dtype}, batch {batch_size})", "elapsed_s": elapsed,
            "output_tokens": num_requested, "output_tok_s": num_requested / elapsed}


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
    parser.add_argument("--save-result", default=None, help="write all figures as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from engine.models.embedded import resolve_model_path
    from transformers import AutoConfig

    model_dir = str(resolve_model_path(None))
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    workload = make_workload(args.num_requests, vocab_size,
                             tuple(map(int, args.prompt_range.split(","))),
                             tuple(map(int, args.output_range.split(","))), args.seed)
    results = [run_engine(workload, args.engine_dtype, args.max_num_seqs, args.max_num_batched_tokens)]
    print(f"{results[0]['system']}: {results[0]['output_tok_s']:.1f} output tok/s", flush=True)
    if not args.skip_hf:
        for dtype_name in args.hf_dtypes.split(","):
            for batch_size in map(int, args.hf_batch_sizes.split(",")):
                result = run_hf(workload, model_dir, getattr(torch, dtype_name), batch_size)
                print(f"{result['system']}: {result['output_tok_s']:.1f} output tok/s", flush=True)
                results.append(result)
    print("\n| system | output tokens | seconds | output tok/s |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['system']} | {r['output_tokens']} | {r['elapsed_s']:.1f} | {r['output_tok_s']:.1f} |")
    if len(results) > 1:
        best_hf = max(results[1:], key=lambda r: r["output_tok_s"])
        ratio = results[0]["output_tok_s"] / best_hf["output_tok_s"]
        print(f"\nratio vs HF's best ({best_hf['system']}): {ratio:.2f}x")
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
