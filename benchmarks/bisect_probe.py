"""CPU time per output token of W32 at another commit's tree: the measure for bisecting a slowdown.

    tools/bisect_perf.sh COMMIT [THREADS] [VARIANT]       # exports the tree, runs this there
    PYTHONPATH=TREE OMP_WAIT_POLICY=PASSIVE python benchmarks/bisect_probe.py TREE [THREADS] [VARIANT]

TREE is a commit's files (git archive), run with today's venv (the dependencies rarely change):
the engine is imported from TREE (trees before the lm_console rename have a top-level `engine`
and `kernels`; their `kernels` is imported first, before transformers can import Hugging Face's
package of that name) and the probe checks that it was. VARIANT is a quantization value
("none": dense bf16, "gguf", or "default": the tree's default). W32 as in
benchmarks/vs_llamacpp.py, greedy, ignore_eos. PROBE_MP=1 runs the engine core in its own process
(its CPU counted from /proc). Prints one line: RESULT {json} with cpu_ms_per_tok.

OMP_WAIT_POLICY=PASSIVE keeps OpenMP's spinning out of the CPU time (it grows with the machine's
load, not with the work); the load average is printed beside the figure: on a shared machine the
CPU time per token still moves 10-20% with it, so compare trees run back to back, more than once.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import sys
import time
from pathlib import Path


def tree_cpu(pid: int) -> float:
    """CPU seconds of `pid` and its live descendants."""
    ticks, total, queue, seen = os.sysconf("SC_CLK_TCK"), 0.0, [pid], set()
    while queue:
        current = queue.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
            for task in os.listdir(f"/proc/{current}/task"):
                queue += [int(c) for c in Path(f"/proc/{current}/task/{task}/children").read_text().split()]
        except (OSError, IndexError):
            pass
    return total


def main() -> None:
    tree = os.path.abspath(sys.argv[1])
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    variant = sys.argv[3] if len(sys.argv) > 3 else "none"
    sys.path.insert(0, tree)
    if os.path.isdir(os.path.join(tree, "engine")):
        import kernels  # type: ignore[import-not-found]

        assert kernels.__file__.startswith(tree), kernels.__file__
        from engine import LLM, SamplingParams  # type: ignore[import-not-found]
    else:
        from lm_console.engine import LLM, SamplingParams
    source = inspect.getsourcefile(LLM) or ""
    assert source.startswith(tree), f"the engine came from {source}, not {tree}"
    rng = random.Random(0)
    requests = [([rng.randrange(100, 49152 - 100) for _ in range(rng.randint(32, 256))], rng.randint(32, 128))
                for _ in range(32)]
    multiprocess = os.environ.get("PROBE_MP") == "1"
    llm = LLM(None, quantization=None if variant == "default" else variant, num_threads=threads,
              multiprocess=multiprocess)
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))
    cpu, wall = tree_cpu(os.getpid()), time.perf_counter()
    outputs = llm.generate(prompts, params)
    cpu, wall = tree_cpu(os.getpid()) - cpu, time.perf_counter() - wall
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print("RESULT", json.dumps({"tree": tree, "variant": variant, "threads": threads, "multiprocess": multiprocess,
                                "tokens": tokens, "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
                                "cpu_ms_per_tok": round(1e3 * cpu / tokens, 3),
                                "loadavg": round(os.getloadavg()[0], 2)}), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
