"""HF transformers `generate` on the same workload, at its best batch size and dtype."""

from __future__ import annotations

import sys
import time
from typing import Any

from lm_console.bench.datasets import BenchRequest


def run_hf(requests: list[BenchRequest], model_dir: str, dtype_name: str, batch_size: int) -> dict[str, Any]:
    """Greedy, left padding, exactly output_len new tokens per request; only those count."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype_name)).eval()
    pad_id = 0
    # Sort by length so each batch pads little, as a careful HF user would.
    ordered = sorted(requests, key=lambda r: r.prompt_len)
    num_output = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(ordered), batch_size):
            batch = ordered[i:i + batch_size]
            width = max(r.prompt_len for r in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, request in enumerate(batch):
                input_ids[row, width - request.prompt_len:] = torch.tensor(request.prompt_token_ids)
                attention_mask[row, width - request.prompt_len:] = 1
            max_new = max(r.output_len for r in batch)
            model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                           max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad_id)
            num_output += sum(r.output_len for r in batch)
    elapsed = time.perf_counter() - start
    num_prompt = sum(r.prompt_len for r in requests)
    return {"system": f"HF transformers ({dtype_name}, batch {batch_size})", "dtype": dtype_name,
            "batch_size": batch_size, "elapsed_time": elapsed, "total_num_output_tokens": num_output,
            "output_tokens_per_second": num_output / elapsed,
            "tokens_per_second": (num_output + num_prompt) / elapsed,
            "requests_per_second": len(requests) / elapsed}


def best_hf(requests: list[BenchRequest], model_dir: str, batch_sizes: list[int],
            dtypes: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run every (dtype, batch size); return the best by output tokens/s and all runs."""
    runs = []
    for dtype_name in dtypes:
        for batch_size in batch_sizes:
            result = run_hf(requests, model_dir, dtype_name, batch_size)
            print(f"  {result['system']}: {result['output_tokens_per_second']:.1f} output tok/s",
                  file=sys.stderr, flush=True)
            runs.append(result)
    return max(runs, key=lambda r: r["output_tokens_per_second"]), runs
