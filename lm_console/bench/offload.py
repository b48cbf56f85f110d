"""`lmc bench offload` and `lmc bench pd`: KV offload TTFT against recompute, tier throughput, and a
prefill/decode hand-off through the shared disk tier.

TTFT is the time from arrival to the first token of a max_tokens=1 request. The repeated prompt
runs after another prompt of the same size has evicted it from the engine's own prefix cache
(the KV cache holds one such prompt), so without offload it is recomputed.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from typing import Any

OFFLOAD_CONNECTOR = "OffloadConnector"


def offload_transfer_config(disk_path: str | None, role: str = "kv_both", cpu_bytes: int = 2 << 30,
                            disk_bytes: int = 16 << 30, chunk_size: int = 256) -> dict[str, Any]:
    """A kv_transfer_config for the OffloadConnector."""
    extra: dict[str, Any] = {"cpu_bytes": cpu_bytes, "disk_bytes": disk_bytes, "chunk_size": chunk_size}
    if disk_path:
        extra["disk_path"] = disk_path
    return {"kv_connector": OFFLOAD_CONNECTOR, "kv_role": role, "kv_connector_extra_config": extra}


def _ttft(llm: Any, prompt: list[int]) -> tuple[float, list[int], int]:
    from lm_console.engine import SamplingParams

    output = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1),
                          use_tqdm=False)[0]
    assert output.metrics is not None and output.metrics.time_to_first_token is not None
    return output.metrics.time_to_first_token, output.outputs[0].token_ids, output.num_cached_tokens


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def bench_offload(model: str | None, engine_args: dict[str, Any], prompt_len: int = 2048, chunk_size: int = 256,
                  disk_path: str | None = None, seed: int = 0) -> dict[str, Any]:
    """Run the TTFT comparison and the tier throughput measurement; returns the figures."""
    from lm_console.engine import LLM

    block_size = engine_args.get("block_size", 16)
    max_model_len = prompt_len + 2 * block_size
    # Exactly one max-length request's blocks (plus the null block); the evicting prompt fills them
    # all, so nothing of the repeated prompt stays in the prefix cache.
    num_blocks = -(-max_model_len // block_size) + 1
    args = {**engine_args, "max_model_len": max_model_len, "num_gpu_blocks_override": num_blocks,
            "multiprocess": False, "max_num_batched_tokens": max(engine_args.get("max_num_batched_tokens", 2048), 512)}
    rng = random.Random(seed)
    tmp = None if disk_path else tempfile.TemporaryDirectory(prefix="lmc-kv-offload-")
    disk = disk_path or tmp.name  # type: ignore[union-attr]
    config = offload_transfer_config(disk, chunk_size=chunk_size)
    results: dict[str, Any] = {"prompt_len": prompt_len, "chunk_size": chunk_size}
    try:
        _log("offload off: cold prompt, an evicting prompt, the repeated prompt (recomputed)")
        llm = LLM(model, **args)
        vocab = llm.config.model_config.vocab_size
        prompt_a = [rng.randrange(10, vocab) for _ in range(prompt_len)]
        prompt_b = [rng.randrange(10, vocab) for _ in range(max_model_len - 1)]
        cold, tokens_off, _ = _ttft(llm, prompt_a)
        _ttft(llm, prompt_b)
        recompute, tokens_re, cached = _ttft(llm, prompt_a)
        assert cached == 0, "the repeated prompt was still in the prefix cache: evict it first"
        llm.shutdown()
        results.update(ttft_cold_s=cold, ttft_recompute_s=recompute)

        _log("offload on: same sequence; the repeated prompt loads from the CPU tier")
        llm = LLM(model, kv_transfer_config=config, **args)
        _ttft(llm, prompt_a)
        _ttft(llm, prompt_b)
        core = llm.engine_core.engine_core
        core.flush_kv_connector()
        offload, tokens_on, cached_on = _ttft(llm, prompt_a)
        results.update(ttft_offload_cpu_s=offload, offload_cached_tokens=cached_on)
        results.update(_tier_throughput(core, chunk_size))
        llm.shutdown()

        _log("restart: a new engine; the repeated prompt loads from the disk tier")
        llm = LLM(model, kv_transfer_config=config, **args)
        restart, tokens_restart, cached_restart = _ttft(llm, prompt_a)
        results.update(ttft_restart_disk_s=restart, restart_cached_tokens=cached_restart,
                       kv_tiers=[{"medium": t.medium, "hits": t.hits, "misses": t.misses, "bytes_out": t.bytes_out}
                                 for t in llm.get_stats().kv_tiers or []])
        llm.shutdown()
    finally:
        if tmp is not None:
            tmp.cleanup()
    results["same_tokens"] = tokens_off == tokens_re == tokens_on == tokens_restart
    results["ratio_offload_cpu"] = results["ttft_offload_cpu_s"] / results["ttft_recompute_s"]
    results["ratio_restart_disk"] = results["ttft_restart_disk_s"] / results["ttft_recompute_s"]
    return results


def _tier_throughput(core: Any, chunk_size: int, repeats: int = 3) -> dict[str, float]:
    """GB/s of the four copies a chunk goes through, on this engine's KV cache and tiers."""
    import os

    import torch

    from lm_console.engine.distributed.kv_transfer.offload.disk_tier import DiskTier
    from lm_console.engine.distributed.kv_transfer.offload.kv_layout import gather_chunk, scatter_chunk

    kv_caches = core.model_executor.worker.model_runner.kv_caches
    block_size = kv_caches[0].shape[2]
    num_blocks = chunk_size // block_size
    block_ids = list(range(1, 1 + num_blocks))
    chunk = gather_chunk(kv_caches, block_ids, chunk_size)
    nbytes = chunk.nbytes

    def best(fn: Any) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return nbytes / min(times) / 1e9

    figures = {"chunk_bytes": float(nbytes)}
    with torch.inference_mode():
        figures["cpu_store_gbps"] = best(lambda: gather_chunk(kv_caches, block_ids, chunk_size))
        figures["cpu_load_gbps"] = best(lambda: scatter_chunk(kv_caches, chunk, 0, block_ids))
    with tempfile.TemporaryDirectory(prefix="lmc-kv-tier-") as path:
        tier = DiskTier(path, capacity_bytes=1 << 34)
        keys = iter(bytes([i]) * 32 for i in range(256))
        figures["disk_write_gbps"] = best(lambda: tier.write(next(keys), chunk))
        key = bytes([0]) * 32
        figures["disk_read_gbps"] = best(lambda: tier.read(key, chunk.dtype, tuple(chunk.shape)))
        # A cold read: ask the kernel to drop the file's pages first (best effort).
        file = next(iter(os.scandir(path))).path

        def cold_read() -> None:
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            tier.read(bytes.fromhex(os.path.basename(file).split(".")[0]), chunk.dtype, tuple(chunk.shape))

        figures["disk_read_cold_gbps"] = best(cold_read)
    return figures


def offload_lines(results: dict[str, Any]) -> list[str]:
    """The report printed by `lmc bench offload` and benchmarks/kv_offload.py."""
    r = results
    return [
        f"repeated {r['prompt_len']}-token prompt, chunk {r['chunk_size']}, greedy outputs identical: {r['same_tokens']}",
        f"TTFT cold (offload off)             {r['ttft_cold_s'] * 1e3:9.1f} ms",
        f"TTFT after eviction, recompute      {r['ttft_recompute_s'] * 1e3:9.1f} ms   1.00x",
        f"TTFT after eviction, CPU tier       {r['ttft_offload_cpu_s'] * 1e3:9.1f} ms   {r['ratio_offload_cpu']:.3f}x"
        f"   ({r['offload_cached_tokens']} tokens loaded)",
        f"TTFT after restart, disk tier       {r['ttft_restart_disk_s'] * 1e3:9.1f} ms   {r['ratio_restart_disk']:.3f}x"
        f"   ({r['restart_cached_tokens']} tokens loaded)",
        f"goal <= 0.3x: {'met' if max(r['ratio_offload_cpu'], r['ratio_restart_disk']) <= 0.3 else 'NOT met'}",
        f"tier throughput (chunk {r['chunk_bytes'] / 2**20:.1f} MiB): CPU store {r['cpu_store_gbps']:.2f} GB/s, "
        f"CPU load {r['cpu_load_gbps']:.2f} GB/s, disk write {r['disk_write_gbps']:.2f} GB/s, "
        f"disk read {r['disk_read_gbps']:.2f} GB/s (page cache), {r['disk_read_cold_gbps']:.2f} GB/s (dropped)",
    ]


def bench_pd(model: str | None, engine_args: dict[str, Any], prompt_len: int = 1024, output_len: int = 16,
             disk_path: str | None = None, chunk_size: int = 256, seed: int = 0) -> dict[str, Any]:
    """Prefill on a producer engine, decode on a consumer engine that loads the producer's KV."""
    from lm_console.engine import LLM, SamplingParams

    args = {**engine_args, "max_model_len": max(engine_args.get("max_model_len") or 0, prompt_len + output_len + 16)}
    tmp = None if disk_path else tempfile.TemporaryDirectory(prefix="lmc-kv-pd-")
    disk = disk_path or tmp.name  # type: ignore[union-attr]
    try:
        producer = LLM(model, kv_transfer_config=offload_transfer_config(disk, "kv_producer", chunk_size=chunk_size), **args)
        consumer = LLM(model, kv_transfer_config=offload_transfer_config(disk, "kv_consumer", chunk_size=chunk_size), **args)
        vocab = producer.config.model_config.vocab_size
        rng = random.Random(seed)
        prompt = {"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(prompt_len)]}
        start = time.perf_counter()
        prefill = producer.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
        prefill_s = time.perf_counter() - start
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                                extra_args={"kv_transfer_params": prefill.kv_transfer_params})
        start = time.perf_counter()
        decoded = consumer.generate([prompt], params, use_tqdm=False)[0]
        decode_s = time.perf_counter() - start
        reference = producer.generate([prompt], SamplingParams(temperature=0.0, max_tokens=output_len,
                                                               ignore_eos=True), use_tqdm=False)[0]
        producer.shutdown()
        consumer.shutdown()
    finally:
        if tmp is not None:
            tmp.cleanup()
    return {"prompt_len": prompt_len, "output_len": output_len, "kv_transfer_params": prefill.kv_transfer_params,
            "prefill_s": prefill_s, "consumer_s": decode_s, "consumer_cached_tokens": decoded.num_cached_tokens,
            "consumer_ttft_s": decoded.metrics.time_to_first_token if decoded.metrics else None,
            "same_tokens": decoded.outputs[0].token_ids == reference.outputs[0].token_ids,
            "text": decoded.outputs[0].text}


def pd_lines(r: dict[str, Any]) -> list[str]:
    ttft = r["consumer_ttft_s"]
    return [
        f"producer prefilled {r['prompt_len']} tokens in {r['prefill_s'] * 1e3:.1f} ms; "
        f"kv_transfer_params={r['kv_transfer_params']}",
        f"consumer loaded {r['consumer_cached_tokens']} tokens, TTFT {ttft * 1e3 if ttft else float('nan'):.1f} ms, "
        f"{r['output_len']} tokens in {r['consumer_s'] * 1e3:.1f} ms",
        f"consumer output identical to a single engine's: {r['same_tokens']}",
    ]
