"""Hybrid KV cache: KV memory and throughput of a Gemma3-style model with and without its
sliding windows, measured in the same run on the same weights.

The baseline is the same checkpoint with every layer switched to full attention (config.json
`layer_types`), so the model shape, the weights and the work per token are equal; only the KV
cache layout differs. Both engines get the same KV budget in bytes (kv_cache_memory), so the
hybrid one holds more requests at once. Printed: peak KV memory in use (layer-blocks: blocks in
use x layers a block spans, i.e. bytes up to a constant), the ratio hybrid / full, and output
tokens/s of each.

    python benchmarks/hybrid_kv.py                       # a random tiny Gemma3 (CPU, ~1 min)
    python benchmarks/hybrid_kv.py --num-requests 32 --prompt-len 512 --output-len 128

The outputs of the two engines differ (different attention), which does not matter here.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def make_dirs(work: Path, window: int, num_layers: int) -> tuple[Path, Path]:
    """(hybrid Gemma3 dir, same weights with every layer full attention)."""
    from model_factory import make_tiny_model_dir

    hybrid = make_tiny_model_dir(work / "hybrid", "gemma3", seed=0, sliding_window=window,
                                 num_hidden_layers=num_layers, max_position_embeddings=8192)
    full = work / "full"
    shutil.copytree(hybrid, full)
    config = json.loads((full / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    (full / "config.json").write_text(json.dumps(config))
    return hybrid, full


def run(model_dir: Path, prompts: list[list[int]], output_len: int, kv_cache_memory: int) -> dict[str, float]:
    from lm_console.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", multiprocess=False, kv_cache_memory=kv_cache_memory,
              max_model_len=len(prompts[0]) + output_len + 16, num_threads=1)
    core = llm.engine_core.engine_core
    kv = core.kv_cache_manager
    layers_per_block = core.kv_cache_config.num_layers_per_block
    peak = {"blocks": 0, "running": 0}
    schedule = core.scheduler.schedule

    def recording_schedule():  # type: ignore[no-untyped-def]
        out = schedule()
        peak["blocks"] = max(peak["blocks"], kv.block_pool.num_gpu_blocks - 1 - kv.num_free_blocks)
        peak["running"] = max(peak["running"], len(core.scheduler.running))
        return out

    core.scheduler.schedule = recording_schedule
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    return {
        "groups": len(core.kv_cache_config.kv_cache_groups),
        "num_blocks": core.kv_cache_config.num_blocks,
        "peak_layer_blocks": peak["blocks"] * layers_per_block,
        "peak_running": peak["running"],
        "preemptions": core.scheduler.num_preemptions_total,
        "tok_per_s": len(prompts) * output_len / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=384)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--kv-cache-memory", type=int, default=2 << 20, help="bytes, for both engines")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lmc_hybrid_kv_"))
    try:
        hybrid_dir, full_dir = make_dirs(work, args.window, args.num_layers)
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 40000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
        results = {name: run(d, prompts, args.output_len, args.kv_cache_memory)
                   for name, d in (("full", full_dir), ("hybrid", hybrid_dir))}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.num_requests} requests x ({args.prompt_len} prompt + {args.output_len} output), "
          f"window {args.window}, {args.num_layers} layers, KV budget {args.kv_cache_memory} bytes")
    print(f"{'':8} {'groups':>6} {'blocks':>7} {'peak layer-blocks':>18} {'peak running':>13} "
          f"{'preempt':>8} {'tok/s':>8}")
    for name, r in results.items():
        print(f"{name:8} {r['groups']:>6} {r['num_blocks']:>7} {r['peak_layer_blocks']:>18} "
              f"{r['peak_running']:>13} {r['preemptions']:>8} {r['tok_per_s']:>8.1f}")
    full, hybrid = results["full"], results["hybrid"]
    print(f"hybrid / full: blocks in the budget {hybrid['num_blocks'] / full['num_blocks']:.2f}x, "
          f"peak concurrent requests {hybrid['peak_running'] / max(full['peak_running'], 1):.2f}x, "
          f"output tok/s {hybrid['tok_per_s'] / full['tok_per_s']:.2f}x")


if __name__ == "__main__":
    main()
