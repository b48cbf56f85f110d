"""What the multimodal caches save, measured in one run (ratios, not absolute times).

1. P0: processing an image prompt with a ProcessorCache miss (HF processor) vs a hit.
2. IPC: bytes of the EngineCoreRequest frames for a miss (arrays in raw frames) vs a hit (data=None).
3. Engine: 8 requests sharing one image vs 8 distinct images (encoder runs and wall time).

Usage: python benchmarks/mm_caches.py [--model demo-vlm | DIR]   (default: a tiny random Idefics3)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    from lm_console.engine import LLM, SamplingParams
    from lm_console.engine.ipc import MsgpackEncoder
    from mm_factory import make_image, make_tiny_idefics3_dir

    model = args.model or str(make_tiny_idefics3_dir(Path(tempfile.mkdtemp()) / "tiny-vlm"))
    llm = LLM(model, multiprocess=False, max_model_len=2048, enable_prefix_caching=False)
    processor = llm.input_processor
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    # 1 + 2: P0 cost and bytes on the wire, miss vs hit.
    miss_s, hit_s = [], []
    miss_bytes = hit_bytes = 0
    encoder = MsgpackEncoder()
    for i in range(args.repeats):
        prompt = {"prompt": "<image>What is it?", "multi_modal_data": {"image": make_image(1000 + i, 320, 240)}}
        for label in ("miss", "hit"):
            start = time.perf_counter()
            _, request = processor.process_inputs(f"{label}{i}", prompt, params)
            processor.finalize_for_send([request])
            (miss_s if label == "miss" else hit_s).append(time.perf_counter() - start)
            size = sum(memoryview(f).nbytes for f in encoder.encode(request))
            if label == "miss":
                miss_bytes = size
            else:
                hit_bytes = size
    miss, hit = sorted(miss_s)[len(miss_s) // 2], sorted(hit_s)[len(hit_s) // 2]
    print(f"P0 processing, median: miss {miss * 1e3:.1f} ms, hit {hit * 1e3:.2f} ms -> {miss / hit:.0f}x faster on a hit")
    print(f"request on the wire: miss {miss_bytes:,} B, hit {hit_bytes:,} B -> {miss_bytes / hit_bytes:.0f}x smaller")

    # 3: encoder cache sharing across requests.
    runner = llm.engine_core.engine_core.model_executor.worker.model_runner.encoder_runner
    timings = {}
    for label, images in (("distinct", [make_image(2000 + i, 320, 240) for i in range(8)]),
                          ("shared", [make_image(3000, 320, 240)] * 8)):
        runs = runner.num_encoder_runs
        start = time.perf_counter()
        llm.generate([{"prompt": f"<image>Question {i}?", "multi_modal_data": {"image": image}}
                      for i, image in enumerate(images)], params, use_tqdm=False)
        timings[label] = time.perf_counter() - start
        print(f"8 requests, {label} images: {runner.num_encoder_runs - runs} encoder runs, {timings[label]:.2f} s")
    print(f"shared / distinct wall time: {timings['shared'] / timings['distinct']:.2f}")
    llm.shutdown()


if __name__ == "__main__":
    main()
