"""The quantized GEMM (lm_console/kernels/cpu_quant.py) against dense bf16 matmuls, one linear at a time.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/quant_gemm.py [--rows 1,4,8,16,32,128]

Shapes are the embedded SmolLM2-135M's linears (b4 = its Q4_1 blocks, the head b8 = Q8_0).
For each shape and row count: the int8 kernel (quant_gemm), the block formats' dequantize +
bf16 matmul, and the dense bf16 matmul (torch / oneDNN); best of several alternating runs, thread
CPU time, with GOP/s (2 * M * N * K) and the weight stream rate (packed bytes / time).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from lm_console.kernels import cpu_quant

SHAPES = (("qkv", 960, 576, "b4"), ("o", 576, 576, "b4"), ("gate_up", 3072, 576, "b4"),
          ("down", 576, 1536, "b4"), ("head", 49152, 576, "b8"))


def _weight(n: int, k: int, fmt: str) -> cpu_quant.QuantWeight:
    rng = np.random.default_rng(0)
    nb = -(-k // 32)
    q = rng.integers(0, 16 if fmt == "b4" else 256, (n, k)).astype(np.uint8)
    d = (rng.random((n, nb)) * 0.01 + 0.001).astype(np.float16)
    m = (-rng.random((n, nb)) * 0.1).astype(np.float16)
    return cpu_quant.pack_blocks(fmt, q, d, m, "bench")


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16,32,128")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    parser.add_argument("--int8-only", action="store_true",
                        help="time only the int8 kernel (faster A/B runs of quant_gemm.c)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"vnni={cpu_quant.has_vnni()} threads={torch.get_num_threads()} load={os.getloadavg()[0]:.1f}")
    print(f"{'shape':8} {'M':>4} {'int8 ms':>8} {'GOP/s':>6} {'GB/s':>5} {'deq+bf16':>8} {'bf16 ms':>8} {'GF/s':>6}")
    for name, n, k, fmt in SHAPES:
        if name not in args.shapes.split(","):
            continue
        qw = _weight(n, k, fmt)
        dense = cpu_quant.dequantize(qw, torch.bfloat16)
        reps = args.reps if n < 10000 else max(2, args.reps // 3)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            t_q = t_dq = t_bf = float("inf")
            for _ in range(2):  # alternate
                t_q = min(t_q, _best(lambda x=x, qw=qw: cpu_quant.quant_gemm(x, qw), reps))
                if args.int8_only:
                    continue
                scratch = torch.empty(n, k, dtype=torch.bfloat16)
                t_dq = min(t_dq, _best(lambda x=x, qw=qw, s=scratch: F.linear(
                    x, cpu_quant.dequantize(qw, torch.bfloat16, out=s)), reps))
                t_bf = min(t_bf, _best(lambda x=x, w=dense: F.linear(x, w), reps))
            ops = 2 * m * n * k
            dense = (f"{t_dq * 1e3:8.3f} {t_bf * 1e3:8.3f} {ops / t_bf / 1e9:6.0f}" if not args.int8_only
                     else f"{'-':>8} {'-':>8} {'-':>6}")
            print(f"{name:8} {m:4} {t_q * 1e3:8.3f} {ops / t_q / 1e9:6.0f} {qw.nbytes() / t_q / 1e9:5.1f} "
                  + dense, flush=True)


if __name__ == "__main__":
    main()
