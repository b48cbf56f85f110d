"""lm-console vs llama.cpp (llama-cpp-python) on the same GGUF file, in one run.

    pip install -e '.[bench]'        # llama-cpp-python, built from source like any user would
    PYTHONPATH=. python benchmarks/vs_llamacpp.py [--gguf FILE] [--variants gguf,none,int8]

Figures, each system on the same file and the same token ids:
- batched: 32 requests, 32-256 random prompt tokens, 32-128 greedy output tokens (ignore_eos);
  output tokens per second over the whole run. lm-console batches them (engine core in its own
  process); llama.cpp runs them twice, one request at a time through llama-cpp-python's
  high-level API and with its own continuous batching (its low-level API, one sequence per
  request): its figure is the better of the two. lm-console's KV cache pages are touched at
  start-up (kv_cache_prefault), as llama.cpp clears its cache when it makes a context. Then
  --rounds - 1 more rounds alternate a fresh lm-console engine with llama.cpp's batching; the
  summary gives each round's ratio and their median (the machine's speed drifts by 10-20%).
- single stream: one request, 32 prompt tokens, decode tokens per second (first token excluded);
  llama.cpp's figure is the better of its high-level generate and its low-level API.
- HF transformers `generate` on the batched workload, best of fp32 / bf16 x batch 16 / 32; each
  later round runs that best configuration again, and the summary gives the rounds' ratios
  against it and their median too.
- per-step breakdown of lm-console's batch-1 decode step (engine core in this process):
  scheduler, input preparation, model forward (+ logits), sampling, output processing.
- cold start: `lmc generate "..." --max-tokens 16` wall time to the first token (warm caches),
  dense and --quantization gguf, with each start-up phase's wall and CPU time.

The development machine is shared: quote the ratios of one run, not the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _record import record  # noqa: E402


def workload(seed: int, vocab: int, n: int = 32) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab - 100) for _ in range(rng.randint(32, 256))], rng.randint(32, 128))
            for _ in range(n)]


def lmc_batched(variant: str | None, requests, threads: int, single: bool = True) -> dict[str, Any]:
    from lm_console.bench.fingerprint import ProcessTreeCpu
    from lm_console.engine import LLM, SamplingParams

    # The KV cache's pages are touched at start-up, as llama.cpp's (cleared when its context is
    # made) and vLLM's (torch.zeros) are: the timed run measures the steady state, not the
    # kernel zeroing pages on first write (lmc serve does the same by default).
    llm = LLM(None, quantization=variant, num_threads=threads, kv_cache_prefault=True)
    try:
        prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        # CPU seconds of this process and the engine core's (a child): on a shared machine the
        # CPU time per token is the steadier figure.
        cpu = ProcessTreeCpu().start()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        cpu_s = cpu.stop()
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        stream = _lmc_single_stream(llm, requests[0][0][:32]) if single else {}
    finally:
        llm.shutdown()
    return {"output_tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed, "cpu_s": cpu_s,
            "tok_per_cpu_s": tokens / cpu_s if cpu_s else None,
            "outputs": [list(o.outputs[0].token_ids) for o in outputs], **stream}


def _lmc_single_stream(llm, prompt: list[int], n: int = 128) -> dict[str, float]:
    from lm_console.engine import SamplingParams

    def run(max_tokens: int) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}],
                     SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - start

    first = min(run(1) for _ in range(2))
    full = min(run(n + 1) for _ in range(2))
    return {"single_decode_tok_s": n / max(full - first, 1e-9)}


def lmc_step_breakdown(variant: str, threads: int, steps: int = 64) -> dict[str, float]:
    """Mean milliseconds per batch-1 decode step, by phase (engine core in this process).

    Each phase's wall time, and "cpu ms" entries: the process CPU time spent in it (all
    threads; on a shared machine the wall times include waiting for a core, CPU time does not).
    "decode stack (C driver)" is the part of the model forward that lm_console/engine/models/decode_stack.py
    ran in one C call (the whole decoder stack of a pure-decode step; absent when it is off).
    """
    from lm_console.engine import LLM, SamplingParams
    from lm_console.engine.models import decode_stack

    llm = LLM(None, quantization=variant, num_threads=threads, multiprocess=False)
    core = llm.engine_core.engine_core
    runner = core.model_executor.worker.model_runner
    totals: dict[str, float] = defaultdict(float)
    cpu: dict[str, float] = defaultdict(float)
    counting = {"on": False}
    patched: list[tuple[Any, str, Any]] = []

    def timed(owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)
        patched.append((owner, name, inner))

        def wrapper(*args, **kwargs):
            start, start_cpu = time.perf_counter(), time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                if counting["on"]:
                    totals[label] += time.perf_counter() - start
                    cpu[label] += time.process_time() - start_cpu
        setattr(owner, name, wrapper)

    timed(core, "step", "step total")
    timed(core.scheduler, "schedule", "scheduler")
    timed(core.scheduler, "update_from_output", "output processing (core)")
    timed(runner, "_prepare_inputs", "input prep")
    timed(runner, "_build_attention_metadata", "attention metadata")
    timed(runner.model, "forward", "model forward")
    timed(decode_stack.DecodeStack, "run", "decode stack (C driver)")
    timed(runner.model, "compute_logits", "lm_head (logits)")
    timed(runner, "sampler", "sampling")
    try:
        prompt = {"prompt_token_ids": list(range(1000, 1032))}
        llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        counting["on"] = True
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
        wall = time.perf_counter() - start
    finally:
        for owner, name, inner in patched:
            setattr(owner, name, inner)
        llm.shutdown()
    result = {k: 1e3 * v / (steps + 1) for k, v in totals.items()}
    result.update({f"{k} cpu ms": 1e3 * v / (steps + 1) for k, v in cpu.items()})
    result["wall per token (incl. frontend)"] = 1e3 * wall / (steps + 1)
    result["host overhead (step - forward - logits)"] = (
        result["step total"] - result["model forward"] - result["lm_head (logits)"])
    return result


def llamacpp(gguf: Path, requests, threads: int) -> dict[str, Any] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(gguf), n_ctx=512, n_batch=512, n_threads=threads, verbose=False)

    def generate(prompt: list[int], n: int) -> int:
        llm.reset()
        count = 0
        for _token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            count += 1
            if count >= n:
                break
        return count

    generate(requests[0][0][:16], 4)
    start = time.perf_counter()
    tokens = sum(generate(ids, n) for ids, n in requests)
    elapsed = time.perf_counter() - start
    prompt = requests[0][0][:32]
    first = min(_timed(lambda: generate(prompt, 1)) for _ in range(2))
    full = min(_timed(lambda: generate(prompt, 129)) for _ in range(2))
    llm.close()
    batched = llamacpp_batched(gguf, requests, threads)
    batched.pop("outputs")
    # The same single stream through the low-level API (no llama-cpp-python sampler per token).
    low_first = min(llamacpp_batched(gguf, [(prompt, 1)], threads)["seconds"] for _ in range(2))
    low_full = min(llamacpp_batched(gguf, [(prompt, 129)], threads)["seconds"] for _ in range(2))
    high_level = 128 / max(full - first, 1e-9)
    low_level = 128 / max(low_full - low_first, 1e-9)
    return {"output_tok_s": max(tokens / elapsed, batched["output_tok_s"]),
            "one_at_a_time_tok_s": tokens / elapsed, "batched_tok_s": batched["output_tok_s"],
            "tokens": tokens, "seconds": elapsed,
            "single_decode_tok_s": max(high_level, low_level),
            "single_decode_high_level_tok_s": high_level, "single_decode_low_level_tok_s": low_level,
            "mode": "best of one request at a time and continuous batching; single stream: best of "
                    "the high-level generate and the low-level API"}


def hf_best(requests, threads: int, batch_sizes: tuple[int, ...] = (16, 32),
            dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> dict[str, Any]:
    """HF transformers `generate` on the same workload, best of dtypes x batch sizes (by default
    the issue's baseline: fp32 / bf16 x 16 / 32), on the embedded model's dense checkpoint."""
    import torch

    from lm_console.engine.models.embedded import resolve_model_path
    from lm_console.bench.datasets import BenchRequest
    from lm_console.bench.hf_baseline import best_hf

    torch.set_num_threads(threads)
    bench = [BenchRequest(list(ids), n) for ids, n in requests]
    best, runs = best_hf(bench, str(resolve_model_path(None)), list(batch_sizes), list(dtypes))
    return {"output_tok_s": best["output_tokens_per_second"], "system": best["system"],
            "dtype": best["dtype"], "batch_size": best["batch_size"],
            "runs": {r["system"]: r["output_tokens_per_second"] for r in runs}}


def llamacpp_batched(gguf: Path, requests, threads: int, kv_unified: bool = False) -> dict[str, Any]:
    """llama.cpp's own continuous batching (its low-level API, as its `parallel` example does):
    every request a sequence of one context (per-sequence KV unless kv_unified), prompts packed
    into batches of up to n_batch tokens, then one token per live sequence per llama_decode,
    greedy (argmax of the logits), each sequence dropped when it has its output tokens."""
    import ctypes

    import llama_cpp as lc
    import numpy as np

    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(gguf).encode(), lc.llama_model_default_params())
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    n_seq, n_batch = len(requests), 512
    per_seq = max(len(ids) + n for ids, n in requests) + 8
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = per_seq * n_seq
    cparams.n_batch = cparams.n_ubatch = n_batch
    cparams.n_seq_max = n_seq
    cparams.kv_unified = kv_unified
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, cparams)
    batch = lc.llama_batch_init(n_batch, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        for i, (token, pos, seq, want) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, int(want)
        batch.n_tokens = len(entries)
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(i: int) -> int:
        row = np.ctypeslib.as_array(ctypes.cast(lc.llama_get_logits_ith(ctx, i),
                                                ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
        return int(row.argmax())

    try:
        start = time.perf_counter()
        pending = [(token, pos, seq, pos == len(ids) - 1)
                   for seq, (ids, _n) in enumerate(requests) for pos, token in enumerate(ids)]
        last: dict[int, int] = {}
        for chunk in range(0, len(pending), n_batch):
            entries = pending[chunk : chunk + n_batch]
            decode(entries)
            for i, (_t, _p, seq, want) in enumerate(entries):
                if want:
                    last[seq] = argmax(i)
        produced = {seq: 1 for seq in last}
        outputs = {seq: [token] for seq, token in last.items()}
        tokens = len(last)
        while True:
            live = [seq for seq in last if produced[seq] < requests[seq][1]]
            if not live:
                break
            decode([(last[seq], len(requests[seq][0]) + produced[seq] - 1, seq, True) for seq in live])
            for i, seq in enumerate(live):
                last[seq] = argmax(i)
                outputs[seq].append(last[seq])
                produced[seq] += 1
                tokens += 1
        elapsed = time.perf_counter() - start
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    return {"output_tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed,
            "kv_unified": kv_unified, "outputs": [outputs[seq] for seq in range(n_seq)]}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# Start-up phases in the order they end (lm_console/engine/startup_trace.py marks them under LMC_STARTUP_TRACE=1).
COLD_PHASES = ("cli", "engine_import", "engine_args", "config", "device", "weights", "kv_cache",
               "engine_core", "tokenizer", "first_token", "done")


def _cold_run(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    """One `lmc generate` process: wall and CPU seconds, and each phase's (wall, CPU) from the marks."""
    from lm_console.engine.startup_trace import parse_marks

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    launch = time.time()
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    phases: dict[str, dict[str, float]] = {}
    last_t, last_cpu, last_pid = launch, 0.0, None
    marks = parse_marks(done.stderr)
    for phase, t, cpu, pid in marks:
        # A phase ends at its mark; its CPU is this process's since the previous mark (the
        # first phase, interpreter start and the CLI's imports, counts from 0).
        phases[phase] = {"wall_s": round(t - last_t, 3),
                         "cpu_s": round(cpu - (last_cpu if pid == last_pid else 0.0), 3)}
        last_t, last_cpu, last_pid = t, cpu, pid
    first = next((t for phase, t, _, _ in marks if phase == "first_token"), None)
    return {"wall_s": round(wall, 3), "first_token_s": None if first is None else round(first - launch, 3),
            "cpu_s": round((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), 3),
            "phases": phases, "text": done.stdout.strip()}


def cold_start(quantizations: tuple[str, ...] = ("", "gguf"), runs: int = 3) -> dict[str, Any]:
    """`lmc generate "..." --max-tokens 16` as a user runs it, one process each time.

    For each quantization ("" = the default): a first run (warms the page cache and any
    conversion cache), then `runs` more; first_run_s / warm_run_s are whole-process wall times
    (warm: the best), first_token_s the launch to the first sampled token, cpu_s the process's
    CPU, phases the per-phase wall and CPU of the best warm run (LMC_STARTUP_TRACE marks).
    The load average is reported beside them: the machine may be shared.
    """
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), LMC_STARTUP_TRACE="1")
    # A user's first run writes the bytecode caches the later runs read; a sandbox that sets
    # PYTHONDONTWRITEBYTECODE would make every "warm" run compile the engine from source again.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    report: dict[str, Any] = {"loadavg_before": os.getloadavg(),
                              "bytecode_cache": "written by the first run (PYTHONDONTWRITEBYTECODE unset)"}
    for quantization in quantizations:
        cmd = [sys.executable, "-m", "lm_console.cli", "generate", "The capital of France is", "--max-tokens", "16"]
        if quantization:
            cmd += ["--quantization", quantization]
        first = _cold_run(cmd, env)
        warm = [_cold_run(cmd, env) for _ in range(runs)]
        best = min(warm, key=lambda r: r["first_token_s"] if r["first_token_s"] is not None else r["wall_s"])
        report[quantization or "default"] = {
            "first_run_s": first["wall_s"], "warm_run_s": min(r["wall_s"] for r in warm),
            "first_token_s": best["first_token_s"], "cpu_s": best["cpu_s"],
            "first_token_s_runs": [r["first_token_s"] for r in warm], "phases": best["phases"],
            "text": best["text"],
        }
    report["loadavg_after"] = os.getloadavg()
    # The keys earlier reports had: the default run's figures.
    default = report[quantizations[0] or "default"]
    report["first_run_s"], report["warm_run_s"] = default["first_run_s"], default["warm_run_s"]
    return report


def _print_cold_phases(cold: dict[str, Any]) -> None:
    """One line per start-up phase: wall and CPU seconds of each variant's best warm run."""
    variants = [k for k, v in cold.items() if isinstance(v, dict) and "phases" in v]
    print("cold start phase".ljust(16) + "".join(f"{v + ' wall/cpu s':>24}" for v in variants))
    for phase in COLD_PHASES:
        cells = []
        for variant in variants:
            times = cold[variant]["phases"].get(phase)
            cells.append("-" if times is None else f"{times['wall_s']:.2f} / {times['cpu_s']:.2f}")
        print(phase.ljust(16) + "".join(f"{cell:>24}" for cell in cells))
    print("to first token".ljust(16) + "".join(f"{str(cold[v]['first_token_s']):>24}" for v in variants),
          f"(loadavg {cold['loadavg_before'][0]:.1f} -> {cold['loadavg_after'][0]:.1f})", flush=True)


def batched_rounds(gguf: Path, requests, threads: int, report: dict[str, Any], rounds: int) -> list[dict[str, float]]:
    """Output tok/s per round: round 0 is the main run's (llama.cpp's better of one at a time and
    its batching), each later one a fresh lm-console engine per variant, then llama.cpp's
    continuous batching and HF's best configuration again (when measured), one after the other:
    HF alone moved 158-189 tok/s within ten minutes on the shared machine, so one HF figure
    makes a noisy denominator."""
    hf = report.get("hf")
    table = [{**{v: r["output_tok_s"] for v, r in report["lmc"].items()},
              "llama.cpp": report["llamacpp"]["output_tok_s"], **({"hf": hf["output_tok_s"]} if hf else {})}]
    for _ in range(1, rounds):
        row = {v: lmc_batched(v, requests, threads, single=False)["output_tok_s"] for v in report["lmc"]}
        row["llama.cpp"] = llamacpp_batched(gguf, requests, threads)["output_tok_s"]
        if hf:
            row["hf"] = hf_best(requests, threads, (hf["batch_size"],), (hf["dtype"],))["output_tok_s"]
        print("round", len(table), json.dumps(row), flush=True)
        table.append(row)
    return table


def _rounds_summary(report: dict[str, Any], variant: str, baseline: str) -> str:
    """The variant's ratio to the baseline in each round and their median, as " (rounds ...; median ...x)"."""
    ratios = [row[variant] / row[baseline] for row in report.get("rounds", []) if baseline in row]
    if not ratios:
        return ""
    return f" (rounds {', '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}x)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", default=None, help="default: the embedded model's file")
    parser.add_argument("--variants", default="gguf,none", help="lm-console quantization values")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", default="", help="comma list of: batched,llamacpp,hf,breakdown,cold")
    parser.add_argument("--rounds", type=int, default=5,
                        help="batched rounds, lm-console and llama.cpp alternating (the machine is shared: "
                             "the summary quotes the median of the rounds' ratios)")
    parser.add_argument("--save-result", default=None)
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    import torch

    from lm_console.engine.models.embedded import DEFAULT_MODEL, _EMBEDDED, _embedded_gguf_path

    torch.set_num_threads(args.threads)
    gguf = Path(args.gguf) if args.gguf else _embedded_gguf_path(_EMBEDDED[DEFAULT_MODEL])
    requests = workload(args.seed, 49152)
    report: dict[str, Any] = {"gguf": str(gguf), "threads": args.threads, "lmc": {}, "breakdown": {}}
    for variant in args.variants.split(","):
        if "batched" not in skip:
            report["lmc"][variant] = lmc_batched(variant, requests, args.threads)
            report["lmc"][variant].pop("outputs")
            print(variant, json.dumps(report["lmc"][variant]), flush=True)
        if "breakdown" not in skip:
            report["breakdown"][variant] = lmc_step_breakdown(variant, args.threads)
            print(variant, "step ms", json.dumps(report["breakdown"][variant]), flush=True)
    if "llamacpp" not in skip:
        try:
            from _llamacpp import prepare

            report["llamacpp_note"] = prepare(gguf)
        except ImportError:
            pass  # llamacpp() says so
        report["llamacpp"] = llamacpp(gguf, requests, args.threads)
        print("llama.cpp", json.dumps(report["llamacpp"]), flush=True)
    if "hf" not in skip:
        report["hf"] = hf_best(requests, args.threads)
        print("HF", json.dumps(report["hf"]), flush=True)
    if "cold" not in skip:
        report["cold_start"] = cold_start()
        print("cold start", json.dumps(report["cold_start"]), flush=True)
        _print_cold_phases(report["cold_start"])
    ref = report.get("llamacpp")
    if ref and "batched" not in skip:
        report["rounds"] = batched_rounds(gguf, requests, args.threads, report, args.rounds)
    if ref:
        for variant, r in report["lmc"].items():
            print(f"{variant}: batched {r['output_tok_s'] / ref['output_tok_s']:.2f}x llama.cpp"
                  f"{_rounds_summary(report, variant, 'llama.cpp')}, "
                  f"single stream {r['single_decode_tok_s'] / ref['single_decode_tok_s']:.2f}x")
    hf = report.get("hf")
    if hf:
        for variant, r in report["lmc"].items():
            print(f"{variant}: batched {r['output_tok_s'] / hf['output_tok_s']:.2f}x HF's best ({hf['system']})"
                  f"{_rounds_summary(report, variant, 'hf')}")
    record("vs_llamacpp", report, args.save_result)  # fingerprinted, appended to benchmarks/history.jsonl


if __name__ == "__main__":
    main()
