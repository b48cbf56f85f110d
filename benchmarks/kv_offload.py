"""KV offload benchmark: TTFT of a repeated 2,048-token prompt after the engine's prefix cache evicted
it, offload off (recompute) vs on (CPU tier) vs after a restart (disk tier); tier throughput in GB/s.

    python benchmarks/kv_offload.py [--model DIR] [--prompt-len 2048] [--dtype auto] [--json out.json]

Ratios are against the recompute TTFT measured in the same run; the goal is <= 0.3x.
"""

from __future__ import annotations

import argparse
import json

from lm_console.bench.offload import bench_offload, offload_lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--disk-path", default=None, help="disk tier directory (default: a temporary one)")
    parser.add_argument("--json", default=None, help="also write the figures as JSON")
    args = parser.parse_args()
    results = bench_offload(args.model, {"dtype": args.dtype}, args.prompt_len, args.chunk_size, args.disk_path)
    print("\n".join(offload_lines(results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
