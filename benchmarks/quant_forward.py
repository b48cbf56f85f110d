"""Whole-model forward of the embedded model: quantized (its GGUF blocks) against dense bf16.

    PYTHONPATH=. python benchmarks/quant_forward.py [--threads 1,2] [--tokens 1,8,32,512]

Per batch size: one forward over `tokens` tokens (no KV cache: attention is plain causal SDPA
over the batch, the same cost in both variants) plus the logits (every token's for a decode
batch up to 32, the last one's for a prefill chunk). The variants alternate, best of several
repeats; thread CPU time and wall time are printed, with the ratio dense / quantized.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def _best(fn, repeats: int) -> tuple[float, float]:
    fn()
    cpu = wall = float("inf")
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu, wall = min(cpu, time.process_time() - c0), min(wall, time.perf_counter() - w0)
    return cpu * 1e3, wall * 1e3


def main() -> None:
    from transformers import AutoConfig

    from lm_console.engine.forward_context import set_forward_context
    from lm_console.engine.models.embedded import resolve_model_path
    from lm_console.engine.models.loader import load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--tokens", default="1,8,32,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model_dir = resolve_model_path(None)
    config = AutoConfig.from_pretrained(model_dir)
    models = {"gguf": load_model(model_dir, config, torch.bfloat16, "cpu", quantization="gguf"),
              "dense": load_model(model_dir, config, torch.bfloat16, "cpu", quantization=None)}
    print(f"load average {os.getloadavg()[0]:.1f}; ms, best of {args.repeats} x {args.rounds} rounds")
    print(f"{'threads':>7} {'tokens':>6} {'gguf cpu':>9} {'wall':>7} {'dense cpu':>9} {'wall':>7} "
          f"{'dense/gguf cpu':>14} {'wall':>6}")
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for tokens in map(int, args.tokens.split(",")):
            ids = torch.randint(0, 40000, (tokens,))
            positions = torch.arange(tokens) + 300
            best = {name: (float("inf"), float("inf")) for name in models}
            for _ in range(args.rounds):
                for name, model in models.items():
                    def step(model=model, ids=ids, positions=positions, tokens=tokens) -> object:
                        hidden = model(ids, positions)
                        return model.compute_logits(hidden if tokens <= 32 else hidden[-1:])

                    with torch.inference_mode(), set_forward_context(None):
                        cpu, wall = _best(step, args.repeats)
                    best[name] = (min(best[name][0], cpu), min(best[name][1], wall))
            (gc, gw), (dc, dw) = best["gguf"], best["dense"]
            print(f"{threads:7d} {tokens:6d} {gc:9.2f} {gw:7.2f} {dc:9.2f} {dw:7.2f} {dc / gc:14.2f} "
                  f"{dw / gw:6.2f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
