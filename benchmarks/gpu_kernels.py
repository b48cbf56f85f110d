"""Kernel timings for benchmarks/gpu_check.sh: decode bandwidth, prefill vs SDPA, RMSNorm.

    python benchmarks/gpu_kernels.py --out DIR         # on a CUDA device
    TRITON_INTERPRET=1 python benchmarks/gpu_kernels.py --out DIR --smoke   # CPU: script check

Decode attention is memory-bound: achieved bandwidth = K/V bytes read / median time, against
the device-to-device copy bandwidth measured in the same run and the H200's ~4.3 TB/s. Prefill
is compared with torch SDPA (FlashAttention) on the same q/k/v, causal, in TFLOP/s.
Times are medians of CUDA-event-timed repetitions after warm-up; inputs are random (never zeros).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H200_BANDWIDTH = 4.3e12  # bytes/s, device-to-device copy counting read + write (KINDS.md)


def time_ms(fn: Callable[[], object], warmup: int = 5, reps: int = 30) -> float:
    """Median milliseconds of fn(): CUDA events on a GPU, perf_counter on CPU (smoke only)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(max(reps // 10, 1)):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def paged_batch(context_lens: list[int], query_lens: list[int], heads: int, kv_heads: int,
                head_dim: int, dtype: torch.dtype, device: torch.device, block_size: int = 16):
    """Random q and caches with shuffled blocks; K/V of the new tokens are already cached."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(sum(blocks) + 1).int()
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    offset = 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = perm[offset : offset + nb]
        offset += nb
    shape = (sum(blocks) + 1, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, device=device, dtype=dtype)
    value_cache = torch.randn(shape, device=device, dtype=dtype)
    q = torch.randn(sum(query_lens), heads, head_dim, device=device, dtype=dtype)
    qsl = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return (q, key_cache, value_cache, table.to(device), qsl.to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Device-to-device copy, bytes read + written per second (the practical ceiling)."""
    src = torch.randn(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (time_ms(lambda: dst.copy_(src)) * 1e-3)


def bench_decode(cases, heads, kv_heads, head_dim, dtype, device) -> list[dict]:
    """Unified vs split-KV decode kernels; bandwidth over the K/V bytes each must read."""
    from lm_console.kernels.paged_attention import paged_attention
    from lm_console.kernels.split_kv_decode import default_num_splits, split_kv_decode

    rows = []
    for num_seqs, context in cases:
        q, kc, vc, table, qsl, seq_lens = paged_batch([context - 1] * num_seqs, [1] * num_seqs,
                                                      heads, kv_heads, head_dim, dtype, device)
        scale = head_dim**-0.5
        kv_bytes = 2 * num_seqs * context * kv_heads * head_dim * kc.element_size()
        unified = lambda: paged_attention(q, kc, vc, table, qsl, seq_lens, scale, max_query_len=1)
        split = lambda: split_kv_decode(q, kc, vc, table, seq_lens, scale)
        err = rel_err(split(), unified())
        t_unified, t_split = time_ms(unified), time_ms(split)
        chosen = "split" if default_num_splits(num_seqs, kv_heads, device) > 1 else "unified"
        t_chosen = t_split if chosen == "split" else t_unified
        rows.append(dict(num_seqs=num_seqs, context=context, heads=heads, kv_heads=kv_heads,
                         kv_gbytes=kv_bytes / 1e9, unified_ms=t_unified, split_ms=t_split,
                         num_splits=default_num_splits(num_seqs, kv_heads, device),
                         backend_choice=chosen, backend_ms=t_chosen,
                         backend_tb_s=kv_bytes / (t_chosen * 1e-3) / 1e12,
                         split_vs_unified_rel_err=err))
    return rows


def bench_prefill(cases, heads, kv_heads, head_dim, dtype, device) -> list[dict]:
    """Causal prompts without cached context: our paged kernel vs SDPA on contiguous q/k/v."""
    from lm_console.kernels.paged_attention import paged_attention

    rows = []
    for num_seqs, length in cases:
        q, kc, vc, table, qsl, seq_lens = paged_batch([0] * num_seqs, [length] * num_seqs,
                                                      heads, kv_heads, head_dim, dtype, device)
        # The same K/V, contiguous per sequence, for SDPA: [B, Hkv, L, D].
        blocks = table.long()[:, : -(-length // kc.shape[1])]
        k = kc[blocks].reshape(num_seqs, -1, kv_heads, head_dim)[:, :length].transpose(1, 2)
        v = vc[blocks].reshape(num_seqs, -1, kv_heads, head_dim)[:, :length].transpose(1, 2)
        k, v = k.contiguous(), v.contiguous()
        qb = q.view(num_seqs, length, heads, head_dim).transpose(1, 2).contiguous()
        scale = head_dim**-0.5
        ours = lambda: paged_attention(q, kc, vc, table, qsl, seq_lens, scale, max_query_len=length)
        group = heads // kv_heads
        k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        sdpa = lambda: F.scaled_dot_product_attention(qb, k_rep, v_rep, is_causal=True, scale=scale)
        ref = sdpa().transpose(1, 2).reshape(-1, heads, head_dim)
        err = rel_err(ours(), ref)
        t_ours, t_sdpa = time_ms(ours), time_ms(sdpa)
        flops = 2 * num_seqs * heads * length * length * head_dim  # causal: half of 4*B*H*L^2*D
        rows.append(dict(num_seqs=num_seqs, length=length, heads=heads, kv_heads=kv_heads,
                         ours_ms=t_ours, sdpa_ms=t_sdpa, ours_tflops=flops / t_ours / 1e9,
                         sdpa_tflops=flops / t_sdpa / 1e9, ours_over_sdpa_time=t_ours / t_sdpa,
                         rel_err_vs_sdpa=err))
    return rows


def bench_rms_norm(num_tokens, hidden, dtype, device) -> dict:
    """Fused residual-add + RMSNorm vs the eager torch composition it replaces."""
    from lm_console.engine.models.layers import RMSNorm
    from lm_console.kernels.rms_norm import fused_add_rms_norm

    x = torch.randn(num_tokens, hidden, device=device, dtype=dtype)
    r = torch.randn_like(x)
    with torch.device(device):  # the layer picks its kernel for the device it is built on
        norm = RMSNorm(hidden, 1e-6, dtype)

    def eager() -> torch.Tensor:
        return norm(x + r)

    t_fused = time_ms(lambda: fused_add_rms_norm(x, r, norm.weight, 1e-6))
    t_eager = time_ms(eager)
    num_bytes = 4 * x.numel() * x.element_size()  # read x, r; write x, r
    return dict(num_tokens=num_tokens, hidden=hidden, fused_ms=t_fused, eager_ms=t_eager,
                fused_tb_s=num_bytes / (t_fused * 1e-3) / 1e12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU interpreter)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    if args.smoke:
        decode_cases, prefill_cases, shapes = [(2, 100), (8, 40)], [(1, 64)], [(8, 2, 32)]
        rms = (8, 64)
    else:  # Qwen3-0.6B heads (16/8) and Llama-3-8B heads (32/8), head_dim 128
        decode_cases = [(256, 1024), (64, 4096), (8, 16384), (1, 65536)]
        prefill_cases = [(4, 2048), (1, 8192)]
        shapes = [(16, 8, 128), (32, 8, 128)]
        rms = (16384, 4096)
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "dtype": str(dtype)}
    import triton

    result["triton"] = triton.__version__
    result["copy_tb_s"] = copy_bandwidth(device, 1 << (20 if args.smoke else 31)) / 1e12
    result["decode"], result["prefill"] = [], []
    for heads, kv_heads, head_dim in shapes:
        result["decode"] += bench_decode(decode_cases, heads, kv_heads, head_dim, dtype, device)
        result["prefill"] += bench_prefill(prefill_cases, heads, kv_heads, head_dim, dtype, device)
    result["rms_norm"] = bench_rms_norm(*rms, dtype, device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lm_console.kernels.json").write_text(json.dumps(result, indent=1))

    print(f"copy bandwidth (read+write): {result['copy_tb_s']:.2f} TB/s; H200 ~4.3 TB/s")
    print("decode  B x ctx      H/Hkv  unified_ms split_ms choice  TB/s  %4.3TB/s  err")
    for d in result["decode"]:
        print(f"        {d['num_seqs']:>3} x {d['context']:<6} {d['heads']}/{d['kv_heads']:<3}"
              f" {d['unified_ms']:9.3f} {d['split_ms']:8.3f} {d['backend_choice']:<7}"
              f"{d['backend_tb_s']:5.2f} {100 * d['backend_tb_s'] * 1e12 / H200_BANDWIDTH:7.1f}%"
              f"  {d['split_vs_unified_rel_err']:.1e}")
    print("prefill B x len      H/Hkv  ours_ms  sdpa_ms  ours_TF  sdpa_TF  ours/sdpa  err")
    for p in result["prefill"]:
        print(f"        {p['num_seqs']:>3} x {p['length']:<6} {p['heads']}/{p['kv_heads']:<3}"
              f" {p['ours_ms']:8.3f} {p['sdpa_ms']:8.3f} {p['ours_tflops']:8.1f}"
              f" {p['sdpa_tflops']:8.1f} {p['ours_over_sdpa_time']:9.2f}"
              f"  {p['rel_err_vs_sdpa']:.1e}")
    r = result["rms_norm"]
    print(f"fused add+rmsnorm {r['num_tokens']}x{r['hidden']}: {r['fused_ms']:.3f} ms "
          f"({r['fused_tb_s']:.2f} TB/s) vs eager torch {r['eager_ms']:.3f} ms")


if __name__ == "__main__":
    main()
