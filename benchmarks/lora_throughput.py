"""Multi-LoRA throughput on the default path: W32 (32 requests at once) with 4 random rank-16
adapters mixed in (8 requests each) vs the same requests without LoRA.

The embedded model as LLM() runs it (bf16, quantized weights, the C decode stack for steps
without adapters), the engine core in this process so that CPU time is this process's.
Adapters cover q/k/v/o/gate/up/down of every layer, B random (non-zero). Prints tokens/s and
CPU seconds per generated token of each run, and the ratio.

    python benchmarks/lora_throughput.py [--requests 32] [--output-len 64] [--threads 2] [--save-result out.json]

The result goes to the benchmark history with the machine's fingerprint (_record.py).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _record import record  # noqa: E402


def write_adapter(path: Path, rank: int, seed: int, layers: int, dims: dict[str, tuple[int, int]]) -> Path:
    """A PEFT-layout adapter with random A and B for every projection of every layer."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module, (d_in, d_out) in dims.items():
            sub = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{sub}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, d_in, generator=gen) / d_in ** 0.5).bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(d_out, rank, generator=gen) / rank ** 0.5 / 4).bfloat16()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(dims), "bias": "none"}))
    return path


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-range", default="64,256")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-result", default=None)
    args = parser.parse_args()
    loadavg_before = os.getloadavg()

    from lm_console.engine import LLM, SamplingParams
    from lm_console.engine.lora import LoRARequest

    low, high = (int(v) for v in args.prompt_range.split(","))
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("no LoRA", f"{args.adapters} adapters r{args.rank}"):
            lora_on = mode != "no LoRA"
            llm = LLM(num_threads=args.threads, multiprocess=False, max_num_seqs=max(args.requests, 32),
                      **({"enable_lora": True, "max_loras": args.adapters, "max_lora_rank": args.rank}
                         if lora_on else {}))
            m = llm.config.model_config
            vocab = m.vocab_size
            prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(low, high))]
                       for _ in range(args.requests)]
            rng.seed(args.seed)  # the same prompts for both runs
            loras = None
            if lora_on:
                q, kv = m.num_attention_heads * m.head_dim, m.num_kv_heads * m.head_dim
                h, i = m.hidden_size, m.intermediate_size
                dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
                adapters = [LoRARequest(f"bench-{k}", k + 1,
                                        str(write_adapter(Path(tmp) / f"a{k}", args.rank, k, m.num_layers, dims)))
                            for k in range(args.adapters)]
                loras = [adapters[j % args.adapters] for j in range(args.requests)]
            # warm-up: one short request per adapter (loads them, compiles the kernels)
            llm.generate([{"prompt_token_ids": prompts[0][:16]}] * (args.adapters if lora_on else 1),
                         SamplingParams(max_tokens=2), use_tqdm=False,
                         lora_request=adapters if lora_on else None)
            llm.reset_prefix_cache()
            cpu0, t0 = cpu_seconds(), time.perf_counter()
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                   lora_request=loras)
            wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            llm.shutdown()
            results[mode] = (tokens / wall, cpu / tokens, wall, tokens)
            print(f"{mode:>20}: {tokens} tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s, "
                  f"{1000 * cpu / tokens:.1f} ms CPU per generated token")
    (base_tps, base_cpu, _, _), (lora_tps, lora_cpu, _, _) = results.values()
    print(f"ratio (LoRA / no LoRA): throughput {lora_tps / base_tps:.2f}x, CPU per token {lora_cpu / base_cpu:.2f}x")
    record("lora_throughput", {
        "config": {k: v for k, v in vars(args).items() if k != "save_result"},
        "runs": {mode: {"output_tok_s": tps, "cpu_ms_per_token": 1000 * cpu, "wall_s": wall, "output_tokens": tokens}
                 for mode, (tps, cpu, wall, tokens) in results.items()},
        "throughput_ratio": lora_tps / base_tps, "cpu_per_token_ratio": lora_cpu / base_cpu,
        "loadavg_before": loadavg_before, "loadavg_after": os.getloadavg(),
    }, args.save_result)


if __name__ == "__main__":
    main()
