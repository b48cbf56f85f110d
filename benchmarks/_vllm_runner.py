"""vLLM's side of benchmarks/vs_vllm.py, run by the Python of vLLM's own venv (tools/vllm_env.sh).

    .venv-vllm/bin/python benchmarks/_vllm_runner.py SPEC.json OUT.json

SPEC: {"model": dir, "requests": [[prompt ids, output tokens], ...], "single_prompt": ids,
"single_tokens": n, "max_model_len": n, "threads_bind": str}. It imports nothing of lm-console (a
venv of its own, another torch): the CPU-time reader below is its own.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and its live descendants (vLLM's engine core is a child process)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total, queue, seen = 0.0, [pid], set()
    while queue:
        current = queue.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
            for task in os.listdir(f"/proc/{current}/task"):
                queue.extend(int(c) for c in Path(f"/proc/{current}/task/{task}/children").read_text().split())
        except (OSError, IndexError, ValueError):
            continue
    return total


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import vllm

    llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=spec["max_model_len"], seed=0)
    requests = spec["requests"]
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    cpu, start = tree_cpu_seconds(os.getpid()), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, tree_cpu_seconds(os.getpid()) - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)

    single = TokensPrompt(prompt_token_ids=spec["single_prompt"])

    def run(max_tokens: int) -> float:
        begin = time.perf_counter()
        llm.generate([single], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - begin

    first = min(run(1) for _ in range(2))
    full = min(run(spec["single_tokens"] + 1) for _ in range(2))
    result = {"output_tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed, "cpu_s": cpu,
              "tok_per_cpu_s": tokens / cpu if cpu else None,
              "single_decode_tok_s": spec["single_tokens"] / max(full - first, 1e-9),
              "vllm": vllm.__version__, "torch": __import__("torch").__version__,
              "outputs": [list(o.outputs[0].token_ids) for o in outputs]}
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
