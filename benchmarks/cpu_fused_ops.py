"""Fused bf16 elementwise CPU kernels (lm_console/kernels/cpu_ops.py) against the torch op chains they replace.

Per op, at a prefill chunk (2048 tokens) and a decode batch (32 tokens) of the embedded model's
shapes (hidden 576, intermediate 1536, 9 + 3 heads of 64): silu(gate) * up, residual add +
RMSNorm, rotary on q and k. Then the whole embedded model's forward (no KV cache: attention is
plain causal SDPA over the batch) with the fused kernels on and off. Process CPU time, best of
several repeats, both sides measured in this run; prints the ratio torch / fused.

    python benchmarks/cpu_fused_ops.py [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lm_console.engine.models.layers import apply_rotary
from lm_console.kernels import cpu_ops

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64


def best_ms(fn: Callable[[], object], iters: int, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(iters):
            fn()
        best = min(best, (time.process_time() - start) / iters * 1e3)
    return best


def op_cases(tokens: int) -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    bf16 = torch.bfloat16
    gate_up = torch.randn(tokens, 2 * INTER).to(bf16)
    x, residual = torch.randn(tokens, HIDDEN).to(bf16), torch.randn(tokens, HIDDEN).to(bf16)
    weight = torch.rand(HIDDEN).to(bf16)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(bf16)
    angles = torch.rand(tokens, HEAD_DIM // 2) * 100
    cos, sin = angles.cos(), angles.sin()
    cos_b, sin_b = cos[:, None].to(bf16), sin[:, None].to(bf16)
    qk_heads = HEADS + KV_HEADS

    def torch_silu() -> object:
        gate, up = gate_up.split(INTER, dim=-1)
        return F.silu(gate) * up

    def torch_add_norm() -> object:
        s = x + residual
        return weight * F.rms_norm(s.float(), (HIDDEN,), eps=1e-5).to(bf16), s

    def torch_rope() -> object:
        qk = apply_rotary(qkv[:, : qk_heads * HEAD_DIM].view(tokens, qk_heads, HEAD_DIM), cos_b, sin_b)
        return qk[:, :HEADS].reshape(tokens, -1), qk[:, HEADS:].reshape(tokens, -1)

    x_fused = x.clone()  # add_rms_norm_ adds residual into it on every call (timing is unaffected)
    return [
        ("silu_and_mul", torch_silu, lambda: cpu_ops.silu_and_mul(gate_up)),
        ("add + rms_norm", torch_add_norm,
         lambda: cpu_ops.add_rms_norm_(x_fused, residual, weight, 1e-5)),
        ("rotary q,k", torch_rope, lambda: cpu_ops.rotary_neox_(qkv, qk_heads, HEAD_DIM, cos, sin)),
    ]


def model_forward_ms(tokens: int, iters: int) -> tuple[float, float]:
    from transformers import AutoConfig

    from lm_console.engine.forward_context import set_forward_context
    from lm_console.engine.models.embedded import resolve_model_path
    from lm_console.engine.models.loader import load_model

    model_dir = resolve_model_path(None)
    ids = torch.randint(0, 40000, (tokens,))
    positions = torch.arange(tokens) + 300
    real_load = cpu_ops.load
    times = []
    for fused in (True, False):
        # The layers pick their kernels when the model is built: build it with them hidden.
        cpu_ops.load = real_load if fused else (lambda: None)  # type: ignore[assignment]
        try:
            model = load_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.bfloat16,
                               torch.device("cpu"))
        finally:
            cpu_ops.load = real_load  # type: ignore[assignment]
        with torch.inference_mode(), set_forward_context(None):
            times.append(best_ms(lambda model=model: model(ids, positions), iters, repeats=3))
    return times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-model", action="store_true", help="only the per-op cases")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_ops.load() is None:
        raise SystemExit("the C kernels are unavailable (no compiler, or LMC_CPU_KERNELS=0)")
    print(f"threads={args.threads}, bf16, process CPU ms (best of 5)")
    for tokens, iters in ((2048, 5), (32, 200)):
        for name, torch_fn, fused_fn in op_cases(tokens):
            t, f = best_ms(torch_fn, iters), best_ms(fused_fn, iters)
            print(f"T={tokens:5d} {name:15s} torch {t:8.3f}  fused {f:8.3f}  {t / f:5.2f}x")
    if not args.skip_model:
        for tokens, iters in ((512, 1), (32, 5)):
            f, t = model_forward_ms(tokens, iters)
            print(f"T={tokens:5d} model forward   torch {t:8.2f}  fused {f:8.2f}  {t / f:5.2f}x")


if __name__ == "__main__":
    main()
