"""CI's performance smoke: output tokens per CPU-second of the dense bf16 and default paths.

    python benchmarks/perf_smoke.py                  # compare with this machine's baseline (CI)
    python benchmarks/perf_smoke.py --update-baseline   # record it anew (make bench-baseline)

A small fixed workload (16 requests, 48-96 random prompt tokens, 24-48 greedy output tokens,
ignore_eos) on the embedded model, through the dense bf16 weights (quantization="none") and the
default (quantization=None: the quantized GGUF path where the CPU has the int8 kernels), engine
core in this process, `--threads` torch threads (default: 2, or fewer where fewer CPUs are
usable). The figure is output tokens per CPU-second of this process (all its threads):
on a shared machine the wall time of a run swings 2-3x with the other processes' load, its CPU time
much less. Each variant runs the workload `--repeats` times on one engine; the best repeat
counts (the one least disturbed by the neighbours' cache and memory traffic).

The baseline is per machine: benchmarks/baselines/<fingerprint id>.json (LMC_BENCH_BASELINES),
the id hashing the CPU model, ISA flags, usable CPUs, memory, torch and Python
(lm_console/bench/fingerprint.py). Absent, this run records it; present, a variant below
(1 - --max-drop) of its baseline fails the run (exit status 1). Only --update-baseline replaces it.

--inject-cpu-ms-per-step N burns N ms of CPU in every model step: a deliberate slowdown that the
smoke must catch (tests/benchmarks/test_perf_smoke.py runs it).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import record  # noqa: E402

from lm_console.bench.fingerprint import fingerprint, fingerprint_id  # noqa: E402
from lm_console.engine import envs  # noqa: E402
from lm_console.engine.platform import usable_cpus  # noqa: E402

BASELINES = Path(__file__).resolve().parent / "baselines"
VARIANTS = {"dense_bf16": {"quantization": "none", "dtype": "bfloat16"}, "default": {}}
WORKLOAD = {"requests": 16, "prompt_range": (48, 96), "output_range": (24, 48), "seed": 0}


def requests(vocab: int = 49152) -> list[tuple[list[int], int]]:
    """The fixed workload: (prompt token ids, output tokens) per request."""
    rng = random.Random(WORKLOAD["seed"])
    low_in, high_in = WORKLOAD["prompt_range"]
    low_out, high_out = WORKLOAD["output_range"]
    return [([rng.randrange(100, vocab - 100) for _ in range(rng.randint(low_in, high_in))],
             rng.randint(low_out, high_out)) for _ in range(WORKLOAD["requests"])]


def burn_cpu_in_steps(milliseconds: float) -> None:
    """Make every model step spend `milliseconds` more CPU time (a deliberate regression)."""
    from lm_console.engine.worker.model_runner import ModelRunner

    inner = ModelRunner.execute_model

    def slowed(self: Any, scheduler_output: Any) -> Any:
        start = time.process_time()
        while time.process_time() - start < milliseconds / 1e3:
            pass
        return inner(self, scheduler_output)

    ModelRunner.execute_model = slowed  # type: ignore[method-assign]


def measure(variant: dict[str, Any], threads: int, repeats: int) -> dict[str, Any]:
    """Output tokens per CPU-second of the best of `repeats` runs of the workload on one engine."""
    from lm_console.engine import LLM, SamplingParams

    llm = LLM(None, num_threads=threads, multiprocess=False, **variant)
    try:
        work = requests()
        prompts = [{"prompt_token_ids": ids} for ids, _ in work]
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in work]
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
        runs = []
        for _ in range(repeats):
            llm.reset_prefix_cache()  # each repeat prefills its prompts again
            cpu, wall = time.process_time(), time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            if tokens != sum(n for _, n in work):
                raise RuntimeError(f"the workload produced {tokens} output tokens, expected {sum(n for _, n in work)}")
            runs.append({"tokens": tokens, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
                         "tok_per_cpu_s": round(tokens / cpu, 2), "tok_per_s": round(tokens / wall, 2)})
        quantization = llm.config.model_config.quantization
    finally:
        llm.shutdown()
    best = max(runs, key=lambda r: r["tok_per_cpu_s"])
    return {"tok_per_cpu_s": best["tok_per_cpu_s"], "quantization": quantization, "runs": runs}


def compare(baseline: dict[str, float], measured: dict[str, float], max_drop: float) -> list[str]:
    """The failures: each variant whose tokens per CPU-second fell more than `max_drop` (a
    fraction) below its baseline; a variant missing from either side is a failure too."""
    failures = []
    for name in sorted(set(baseline) | set(measured)):
        if name not in baseline or name not in measured:
            failures.append(f"{name}: in {'the measurement' if name in measured else 'the baseline'} only "
                            "(run make bench-baseline after changing the variants)")
            continue
        ratio = measured[name] / baseline[name]
        if ratio < 1.0 - max_drop:
            failures.append(f"{name}: {measured[name]:.1f} output tok per CPU-second is {ratio:.2f}x the "
                            f"baseline's {baseline[name]:.1f} (more than a {max_drop:.0%} drop)")
    return failures


def baselines_dir() -> Path:
    return Path(envs.LMC_BENCH_BASELINES.get()) if envs.LMC_BENCH_BASELINES.is_set() else BASELINES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=min(2, usable_cpus()))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-drop", type=float, default=0.25, help="the fraction of the baseline that may be lost")
    parser.add_argument("--update-baseline", action="store_true", help="record this run as the machine's baseline")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {', '.join(VARIANTS)}")
    parser.add_argument("--inject-cpu-ms-per-step", type=float, default=0.0,
                        help="a deliberate slowdown: burn this much CPU in every model step")
    parser.add_argument("--save-result", default=None)
    args = parser.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or not names:
        parser.error(f"--variants: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(VARIANTS)}")
    if args.repeats < 1 or args.threads < 1 or not 0.0 < args.max_drop < 1.0:
        parser.error("--repeats and --threads must be at least 1, --max-drop within (0, 1)")
    if args.inject_cpu_ms_per_step > 0:
        burn_cpu_in_steps(args.inject_cpu_ms_per_step)

    start = time.perf_counter()
    results = {name: measure(VARIANTS[name], args.threads, args.repeats) for name in names}
    measured = {name: r["tok_per_cpu_s"] for name, r in results.items()}
    print_ = fingerprint()
    path = baselines_dir() / f"{fingerprint_id(print_)}.json"
    status, failures = "recorded", []
    if path.exists() and not args.update_baseline:
        baseline = json.loads(path.read_text())
        failures = compare({n: baseline["tok_per_cpu_s"][n] for n in names if n in baseline["tok_per_cpu_s"]},
                           measured, args.max_drop)
        status = "failed" if failures else "passed"
        for name in names:
            if name in baseline["tok_per_cpu_s"]:
                print(f"{name}: {measured[name]:.1f} output tok/CPU-s, baseline {baseline['tok_per_cpu_s'][name]:.1f} "
                      f"({measured[name] / baseline['tok_per_cpu_s'][name]:.2f}x)")
    if status == "recorded" or args.update_baseline:
        status = "recorded"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"fingerprint": {k: v for k, v in print_.items() if k != "load_average"},
                                    "recorded_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                                    "load_average_when_recorded": print_["load_average"],
                                    "workload": WORKLOAD, "threads": args.threads, "tok_per_cpu_s": measured,
                                    "results": results}, indent=1) + "\n")
        print(f"baseline recorded in {path}: {json.dumps(measured)}")
    record("perf_smoke", {"threads": args.threads, "workload": WORKLOAD, "status": status,
                          "inject_cpu_ms_per_step": args.inject_cpu_ms_per_step, "tok_per_cpu_s": measured,
                          "results": results, "seconds": round(time.perf_counter() - start, 1)},
           args.save_result)
    for failure in failures:
        print("PERF REGRESSION:", failure, file=sys.stderr)
    print(f"perf smoke {status} in {time.perf_counter() - start:.0f} s ({args.threads} threads, "
          f"machine {path.stem})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
