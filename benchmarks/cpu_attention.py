"""CPU attention: the C kernels against the torch path, on the embedded model's shapes.

Decode: B requests with `ctx` tokens of context in scattered blocks, one layer (9 query heads
over 3 kv heads, head_dim 64), the C kernel vs the padded gather + batched matmuls; then a
whole 30-layer decode step (32 requests at 432 tokens) whose K/V come from DRAM. Prefill: one
T-token chunk (and five 400-token prompts in one call, as in an engine step), the C kernel vs
torch SDPA. Both measured in this run, best of several repeats;
prints the ratio (torch time / kernel time). With bf16 (and kernels that take it), the int8 KV
cache against the bf16 one, both on the C kernels: the 30-layer decode step, a prefill call
and the cache writer (ratio: bf16 time / int8 time).

    python benchmarks/cpu_attention.py [--threads 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lm_console.engine.attention import torch_backend
from lm_console.engine.attention.metadata import AttentionMetadata
from lm_console.kernels.huge_pages import zeros_huge_pages
from lm_console.kernels import cpu_attention

BLOCK_SIZE, NUM_KV_HEADS, GROUP, HEAD_DIM, NUM_BLOCKS = 16, 3, 3, 64, 4000


# Wall clock by default; with --threads 1, process CPU time (steadier on a shared machine).
CLOCK: Callable[[], float] = time.perf_counter


def best_ms(fn: Callable[[], object], iters: int = 10, repeats: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = CLOCK()
        for _ in range(iters):
            fn()
        best = min(best, (CLOCK() - start) / iters * 1e3)
    return best


def _torch_decodes(q: torch.Tensor, cache: torch.Tensor, groups: list) -> None:
    """The torch backend's decode path (padded gather + batched matmuls) for one layer."""
    for group in groups:
        rows = q[: len(group.seq_lens)] if group.token_idx is None else q.index_select(0, group.token_idx)
        torch_backend._attend_decodes(rows, cache, group, NUM_KV_HEADS, HEAD_DIM ** -0.5, None, None)


def decode_case(dtype: torch.dtype, batch: int, ctx: int) -> tuple[float, float]:
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    max_blocks = -(-ctx // BLOCK_SIZE)
    table = torch.randperm(NUM_BLOCKS)[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    q = torch.randn(batch, NUM_KV_HEADS * GROUP * HEAD_DIM, dtype=dtype)
    out = torch.empty_like(q)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    md = AttentionMetadata(batch, batch, torch.arange(batch + 1, dtype=torch.int32), seq_lens, table,
                           torch.full((batch,), -1, dtype=torch.long), 1, ctx,
                           list(range(batch + 1)), [ctx] * batch, BLOCK_SIZE)
    groups = torch_backend._group_decodes(md, list(range(batch)))

    def torch_path() -> None:
        _torch_decodes(q, cache, groups)

    kernel = best_ms(lambda: cpu_attention.paged_decode_attention(
        q, out, cache, table, seq_lens, None, NUM_KV_HEADS, HEAD_DIM ** -0.5))
    return kernel, best_ms(torch_path)


def filled_cache(num_blocks: int, dtype: torch.dtype, int8: bool = False) -> torch.Tensor:
    """A cache of random K/V on huge pages (as the engine allocates it); int8: bf16 rows quantized
    by the cache writer, a chunk of slots at a time."""
    if not int8:
        cache = zeros_huge_pages((2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype, torch.device("cpu"))
        return cache.normal_()
    shape = cpu_attention.int8_cache_shape(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    cache = zeros_huge_pages(shape, torch.int8, torch.device("cpu"))
    slots = num_blocks * BLOCK_SIZE
    for start in range(0, slots, 1 << 16):
        rows = torch.randn(min(1 << 16, slots - start), NUM_KV_HEADS * HEAD_DIM).bfloat16()
        cpu_attention.reshape_and_cache(rows, rows.roll(1, 0), cache, torch.arange(start, start + rows.shape[0]))
    return cache


def decode_step_case(dtype: torch.dtype, batch: int, ctx: int, layers: int = 30, int8: bool = False) -> tuple[float, float]:
    """A whole decode step's attention: `layers` layers, each with its own scattered blocks, in
    one cache of hundreds of MB (on huge pages, as the engine allocates it), so K/V come from
    DRAM as in the engine rather than from the L3 cache a one-layer case fits in. int8: the int8
    KV cache (the torch path then dequantizes what it gathers)."""
    max_blocks = -(-ctx // BLOCK_SIZE)
    num_blocks = layers * batch * max_blocks + 1
    cache = filled_cache(num_blocks, dtype, int8)
    tables = torch.randperm(num_blocks)[: layers * batch * max_blocks].view(layers, batch, max_blocks).to(torch.int32)
    q = torch.randn(batch, NUM_KV_HEADS * GROUP * HEAD_DIM, dtype=dtype)
    out = torch.empty_like(q)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    metadata = [AttentionMetadata(batch, batch, torch.arange(batch + 1, dtype=torch.int32), seq_lens, table,
                                  torch.full((batch,), -1, dtype=torch.long), 1, ctx,
                                  list(range(batch + 1)), [ctx] * batch, BLOCK_SIZE) for table in tables]
    groups = [torch_backend._group_decodes(md, list(range(batch))) for md in metadata]

    def kernel_step() -> None:
        for table in tables:
            cpu_attention.paged_decode_attention(q, out, cache, table, seq_lens, None, NUM_KV_HEADS,
                                                 HEAD_DIM ** -0.5)

    def torch_step() -> None:
        for layer_groups in groups:
            _torch_decodes(q, cache, layer_groups)

    return best_ms(kernel_step, iters=1, repeats=5), best_ms(torch_step, iters=1, repeats=3)


def int8_cases() -> None:
    """The int8 KV cache against bf16, both on the C kernels, measured alternately in this run."""
    print(f"{'int8 KV cache vs bf16':28s} {'int8 ms':>12s} {'bf16 ms':>10s} {'ratio':>7s}")
    for batch, ctx in ((29, 230), (32, 432)):
        (int8, _), (bf16, _) = decode_step_case(torch.bfloat16, batch, ctx, int8=True), \
            decode_step_case(torch.bfloat16, batch, ctx)
        print(f"{f'decode step B={batch} ctx={ctx}':28s} {int8:12.2f} {bf16:10.2f} {bf16 / int8:6.2f}x")
    prompts, length = 5, 400
    table = torch.randperm(NUM_BLOCKS)[: prompts * (length // BLOCK_SIZE)].view(prompts, -1).to(torch.int32)
    q = torch.randn(prompts * length, NUM_KV_HEADS * GROUP * HEAD_DIM, dtype=torch.bfloat16)
    out, lens = torch.empty_like(q), torch.full((prompts,), length, dtype=torch.int32)
    starts = torch.arange(prompts, dtype=torch.int32) * length
    times = [best_ms(lambda cache=cache: cpu_attention.paged_prefill_attention(
        q, out, cache, table, starts, lens, lens, NUM_KV_HEADS, HEAD_DIM ** -0.5), iters=3)
        for cache in (filled_cache(NUM_BLOCKS, torch.bfloat16, True), filled_cache(NUM_BLOCKS, torch.bfloat16))]
    print(f"{'prefill 5xT=400':28s} {times[0]:12.2f} {times[1]:10.2f} {times[1] / times[0]:6.2f}x")
    rows = torch.randn(1536, NUM_KV_HEADS * HEAD_DIM).bfloat16()
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:1536]
    times = [best_ms(lambda cache=cache: [cpu_attention.reshape_and_cache(rows, rows, cache, slots) for _ in range(30)])
             for cache in (filled_cache(NUM_BLOCKS, torch.bfloat16, True), filled_cache(NUM_BLOCKS, torch.bfloat16))]
    print(f"{'write 1536 tokens x 30':28s} {times[0]:12.2f} {times[1]:10.2f} {times[1] / times[0]:6.2f}x")


def prefill_case(dtype: torch.dtype, length: int, prompts: int = 1) -> tuple[float, float]:
    """`prompts` prompts of `length` tokens in one kernel call (as in one engine step)."""
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    num_blocks = -(-length // BLOCK_SIZE)
    table = torch.randperm(NUM_BLOCKS)[: prompts * num_blocks].view(prompts, -1).to(torch.int32)
    kv = [[cache[i][row.long()].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:length].transpose(0, 1)
           for i in (0, 1)] for row in table]
    q = torch.randn(prompts * length, NUM_KV_HEADS * GROUP * HEAD_DIM, dtype=dtype)
    out = torch.empty_like(q)
    lens = torch.full((prompts,), length, dtype=torch.int32)
    starts = torch.arange(prompts, dtype=torch.int32) * length
    qh = q.view(prompts, length, -1, HEAD_DIM).transpose(1, 2)
    kernel = best_ms(lambda: cpu_attention.paged_prefill_attention(
        q, out, cache, table, starts, lens, lens, NUM_KV_HEADS, HEAD_DIM ** -0.5), iters=3)

    def sdpa() -> None:
        for i, (k, v) in enumerate(kv):
            F.scaled_dot_product_attention(qh[i : i + 1], k[None], v[None], is_causal=True,
                                           enable_gqa=True)

    return kernel, best_ms(sdpa, iters=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.process_time if args.threads == 1 else time.perf_counter
    torch.manual_seed(0)
    if cpu_attention.load() is None:
        raise SystemExit("the C kernels are unavailable (no compiler, or LMC_CPU_KERNELS=0)")
    dtype = getattr(torch, args.dtype)
    clock = "process CPU time" if CLOCK is time.process_time else "wall clock"
    print(f"{args.dtype}, {args.threads} threads, 9 heads over 3 kv heads, head_dim 64 (one layer), {clock}")
    print(f"{'case':28s} {'C kernel ms':>12s} {'torch ms':>10s} {'ratio':>7s}")
    for batch, ctx in ((32, 128), (32, 432), (64, 600)):
        kernel, base = decode_case(dtype, batch, ctx)
        print(f"{f'decode B={batch} ctx={ctx}':28s} {kernel:12.2f} {base:10.2f} {base / kernel:6.2f}x")
    kernel, base = decode_step_case(dtype, 32, 432)
    print(f"{'decode step, 30 layers':28s} {kernel:12.2f} {base:10.2f} {base / kernel:6.2f}x")
    for length, prompts in ((128, 1), (272, 1), (512, 1), (400, 5)):
        kernel, base = prefill_case(dtype, length, prompts)
        name = f"prefill {'' if prompts == 1 else f'{prompts}x'}T={length} (vs SDPA)"
        print(f"{name:28s} {kernel:12.2f} {base:10.2f} {base / kernel:6.2f}x")
    if dtype == torch.bfloat16 and cpu_attention.supports_int8(HEAD_DIM, NUM_KV_HEADS * GROUP, NUM_KV_HEADS):
        int8_cases()


if __name__ == "__main__":
    main()
