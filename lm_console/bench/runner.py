"""The three benchmarks end to end: build the workload, run it, print, save, compare with HF."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from typing import Any

from lm_console.bench.datasets import BenchRequest, length_range, random_dataset, shared_prefix_dataset
from lm_console.bench.offline import OfflineEngine, throughput_lines
from lm_console.bench.report import baseline_lines, header, line, save_result


@dataclass
class Workload:
    """Which dataset and its sizes (vLLM's flag names)."""

    dataset_name: str = "random"  # random | prefix
    num_prompts: int = 64
    random_input_len: int = 128
    random_output_len: int = 64
    random_range_ratio: float = 0.5
    prefix_len: int = 256
    suffix_len: int = 32
    num_prefixes: int = 4
    seed: int = 0
    input_range: tuple[int, int] | None = None  # explicit (min, max), instead of len and ratio
    output_range: tuple[int, int] | None = None

    def build(self, vocab_size: int) -> list[BenchRequest]:
        if self.dataset_name == "prefix":
            return shared_prefix_dataset(self.num_prompts, self.prefix_len, self.suffix_len,
                                         self.num_prefixes, self.random_output_len, vocab_size, self.seed)
        if self.dataset_name != "random":
            raise ValueError(f"--dataset-name must be random or prefix, got {self.dataset_name!r}")
        inputs = self.input_range or length_range(self.random_input_len, self.random_range_ratio)
        outputs = self.output_range or length_range(self.random_output_len, self.random_range_ratio)
        return random_dataset(self.num_prompts, inputs, outputs, vocab_size, self.seed)


@dataclass
class Baseline:
    """--baseline hf and the HF configurations to try."""

    kind: str = "none"  # none | hf
    batch_sizes: tuple[int, ...] = (8, 16, 32)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")

    def run(self, requests: list[BenchRequest], model_dir: str) -> dict[str, Any] | None:
        if self.kind == "none":
            return None
        if self.kind != "hf":
            raise ValueError(f"--baseline must be none or hf, got {self.kind!r}")
        from lm_console.bench.hf_baseline import best_hf

        print("Running the HF transformers baseline on the same workload…", file=sys.stderr, flush=True)
        best, runs = best_hf(requests, model_dir, list(self.batch_sizes), list(self.dtypes))
        return {**best, "runs": runs}


def _echo(lines: list[str]) -> None:
    print("\n".join(lines), flush=True)


def bench_throughput(model: str | None, engine_args: dict[str, Any], workload: Workload,
                     baseline: Baseline, save_path: str | None, progress: bool = True) -> int:
    """Offline throughput; returns the number of failed requests."""
    engine = OfflineEngine.build(model, engine_args)
    try:
        requests = workload.build(engine.vocab_size)
        engine.warm_up()
        result = engine.run(requests, use_tqdm=progress)
    finally:
        engine.shutdown()
    hf = baseline.run(requests, engine.model_dir)
    _echo(throughput_lines(result) + baseline_lines(result["output_tokens_per_second"], hf))
    extra = {"backend": "lm-console", "model_id": model or "SmolLM2-135M-Instruct", "dtype": engine.dtype,
             "dataset_name": workload.dataset_name}
    if hf is not None:
        extra["baseline"] = hf
        extra["ratio_vs_baseline"] = result["output_tokens_per_second"] / hf["output_tokens_per_second"]
    save_result(save_path, {**result, **extra})
    return result["failed"]


def bench_prefix(model: str | None, engine_args: dict[str, Any], workload: Workload,
                 baseline: Baseline, save_path: str | None, progress: bool = True) -> int:
    """The same shared-prefix prompts with prefix caching on, then off."""
    runs: dict[str, dict[str, Any]] = {}
    requests: list[BenchRequest] = []
    model_dir = ""
    for enabled in (True, False):
        engine = OfflineEngine.build(model, {**engine_args, "enable_prefix_caching": enabled})
        try:
            requests = requests or workload.build(engine.vocab_size)
            model_dir = engine.model_dir
            engine.warm_up()
            runs["on" if enabled else "off"] = engine.run(requests, use_tqdm=progress)
        finally:
            engine.shutdown()
    on, off = runs["on"], runs["off"]
    speedup = off["elapsed_time"] / on["elapsed_time"]
    hit_rate = on["num_cached_tokens"] / max(on["total_num_prompt_tokens"], 1)
    lines = [header("Prefix Caching Benchmark Result"),
             line("Prompts:", len(requests)),
             line("Shared prefix / suffix tokens:", f"{workload.prefix_len} / {workload.suffix_len}"),
             line("Prefix cache hit rate (tokens):", f"{hit_rate * 100:.1f}%"),
             line("Elapsed, caching on (s):", float(on["elapsed_time"])),
             line("Elapsed, caching off (s):", float(off["elapsed_time"])),
             line("Speedup (off / on):", float(speedup)),
             "--- caching on ---", *throughput_lines(on), "--- caching off ---", *throughput_lines(off)]
    hf = baseline.run(requests, model_dir)
    _echo(lines + baseline_lines(on["output_tokens_per_second"], hf) + ["=" * 50])
    result = {**on, "backend": "lm-console", "model_id": model or "SmolLM2-135M-Instruct",
              "prefix_caching_on": on, "prefix_caching_off": off, "speedup": speedup,
              "prefix_cache_hit_rate": hit_rate}
    if hf is not None:
        result["baseline"] = hf
        result["ratio_vs_baseline"] = on["output_tokens_per_second"] / hf["output_tokens_per_second"]
    save_result(save_path, result)
    return on["failed"] + off["failed"]


def bench_serve(model: str | None, engine_args: dict[str, Any], workload: Workload, baseline: Baseline,
                save_path: str | None, request_rate: float, burstiness: float, max_concurrency: int | None,
                percentile_metrics: list[str], percentiles: list[float], progress: bool = True) -> int:
    """AsyncLLM at a request rate; returns the number of failed requests."""
    from lm_console.bench.serve import run_serve, serve_metrics, serve_summary

    async def main() -> tuple[list[BenchRequest], list[Any], float]:
        from lm_console.engine.frontend.async_llm import AsyncLLM

        llm = AsyncLLM(model, **engine_args)
        try:
            requests = workload.build(len(llm.get_tokenizer()))
            await run_serve(llm, requests[:2], float("inf"), 1.0, None, progress=False)  # warm-up
            results, duration = await run_serve(llm, requests, request_rate, burstiness, max_concurrency,
                                                workload.seed, progress)
            return requests, results, duration
        finally:
            llm.shutdown()

    requests, results, duration = asyncio.run(main())
    metrics = serve_metrics(results, duration, percentile_metrics, percentiles)
    lines = serve_summary(metrics, max_concurrency, request_rate, percentile_metrics, percentiles)
    model_dir = ""
    if baseline.kind != "none":
        from lm_console.engine.models.embedded import resolve_model_path

        model_dir = str(resolve_model_path(model))
    hf = baseline.run(requests, model_dir)
    _echo(lines + baseline_lines(metrics["output_throughput"], hf))
    result = {"backend": "lm-console", "model_id": model or "SmolLM2-135M-Instruct",
              "tokenizer_id": model or "SmolLM2-135M-Instruct", "num_prompts": len(requests),
              "request_rate": request_rate if request_rate != float("inf") else "inf",
              "burstiness": burstiness, "max_concurrency": max_concurrency, **metrics}
    if hf is not None:
        result["baseline"] = hf
        result["ratio_vs_baseline"] = metrics["output_throughput"] / hf["output_tokens_per_second"]
    save_result(save_path, result)
    return metrics["failed"]
