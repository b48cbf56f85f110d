"""Prefill/decode disaggregation through the OffloadConnector's shared disk tier.

A producer engine (kv_role=kv_producer) prefills the prompt and stores its KV chunks; its output
carries kv_transfer_params. A consumer engine (kv_role=kv_consumer) receives the request with
those params (SamplingParams.extra_args["kv_transfer_params"]), waits for the chunks to land on
disk, loads them, and decodes. The two engines are separate engine-core processes.

    python examples/pd_disaggregation.py [--model DIR] [--prompt-len 1024] [--output-len 16]
"""

from __future__ import annotations

import argparse

from lm_console.bench.offload import bench_pd, pd_lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--disk-path", default=None)
    args = parser.parse_args()
    result = bench_pd(args.model, {}, args.prompt_len, args.output_len, args.disk_path)
    print("\n".join(pd_lines(result)))
    print(f"consumer text: {result['text']!r}")


if __name__ == "__main__":
    main()
