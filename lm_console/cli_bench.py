"""`lmc bench throughput | serve | prefix`: thin Typer commands over lm_console.bench.runner."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Optional

import typer

from lm_console.engine_options import ModelOpt, engine_flags
from lm_console.remote_options import ApiKeyOpt, UrlOpt, refuse_local_flags

bench_app = typer.Typer(help="Benchmarks after `vllm bench`: throughput, serve, prefix.", no_args_is_help=True)

NumPromptsOpt = Annotated[int, typer.Option(help="Number of requests.")]
InputLenOpt = Annotated[int, typer.Option(help="random: mean prompt tokens.")]
OutputLenOpt = Annotated[int, typer.Option(help="Mean output tokens (exact for prefix).")]
RangeRatioOpt = Annotated[float, typer.Option(help="random: lengths uniform in mean * [1 - r, 1 + r].")]
PrefixLenOpt = Annotated[int, typer.Option(help="prefix: shared prefix tokens.")]
SuffixLenOpt = Annotated[int, typer.Option(help="prefix: distinct suffix tokens per prompt.")]
NumPrefixesOpt = Annotated[int, typer.Option(help="prefix: number of distinct prefixes.")]
SeedOpt = Annotated[int, typer.Option(help="Workload seed.")]
SaveOpt = Annotated[Optional[str], typer.Option(help="Write the result as JSON (vLLM's keys).")]
BaselineOpt = Annotated[str, typer.Option(help="none | hf: also run HF transformers on the same workload.")]
HfBatchOpt = Annotated[str, typer.Option(help="HF baseline batch sizes to try.")]
HfDtypesOpt = Annotated[str, typer.Option(help="HF baseline dtypes to try.")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr.")]


def _finish(run: Callable[[], int]) -> None:
    """Run a benchmark; exit 1 when requests failed, 2 when the engine could not run it."""
    from lm_console.engine.errors import EngineError

    from lm_console.bench.launcher import ServeLaunchError
    from lm_console.client.types import EngineUnavailable

    try:
        num_failed = run()
    except (EngineError, ValueError, EngineUnavailable, ServeLaunchError) as error:
        hint = getattr(error, "hint", "")
        typer.echo(f"error: {type(error).__name__}: {error}" + (f"\n{hint}" if hint else ""), err=True)
        raise typer.Exit(2) from error
    if num_failed:
        typer.echo(f"error: {num_failed} request(s) failed", err=True)
        raise typer.Exit(1)


def _baseline(kind: str, batch_sizes: str, dtypes: str):  # noqa: ANN202
    from lm_console.bench.runner import Baseline

    if kind not in ("none", "hf"):
        raise typer.BadParameter(f"--baseline must be none or hf, got {kind!r}")
    return Baseline(kind, tuple(int(b) for b in batch_sizes.split(",")), tuple(dtypes.split(",")))


@bench_app.command()
@engine_flags()
def throughput(
    engine_kwargs: dict[str, Any],
    model: ModelOpt = None,
    dataset_name: Annotated[str, typer.Option(help="random | prefix (shared prefixes).")] = "random",
    num_prompts: NumPromptsOpt = 64, random_input_len: InputLenOpt = 128, random_output_len: OutputLenOpt = 64,
    random_range_ratio: RangeRatioOpt = 0.5, prefix_len: PrefixLenOpt = 256, suffix_len: SuffixLenOpt = 32,
    num_prefixes: NumPrefixesOpt = 4, seed: SeedOpt = 0, save_result: SaveOpt = None,
    baseline: BaselineOpt = "none", hf_batch_sizes: HfBatchOpt = "8,16,32",
    hf_dtypes: HfDtypesOpt = "float32,bfloat16", progress: ProgressOpt = True,
) -> None:
    """Offline throughput (engine.LLM) on a random or shared-prefix workload."""
    from lm_console.bench.runner import Workload, bench_throughput

    workload = Workload(dataset_name, num_prompts, random_input_len, random_output_len, random_range_ratio,
                        prefix_len, suffix_len, num_prefixes, seed)
    args = dict(engine_kwargs)
    hf = _baseline(baseline, hf_batch_sizes, hf_dtypes)
    _finish(lambda: bench_throughput(model, args, workload, hf, save_result, progress))


@bench_app.command()
@engine_flags()
def serve(
    ctx: typer.Context,
    engine_kwargs: dict[str, Any],
    model: ModelOpt = None,
    dataset_name: Annotated[str, typer.Option(help="random | prefix (shared prefixes).")] = "random",
    num_prompts: NumPromptsOpt = 64, random_input_len: InputLenOpt = 128, random_output_len: OutputLenOpt = 64,
    random_range_ratio: RangeRatioOpt = 0.5, prefix_len: PrefixLenOpt = 256, suffix_len: SuffixLenOpt = 32,
    num_prefixes: NumPrefixesOpt = 4, seed: SeedOpt = 0,
    request_rate: Annotated[float, typer.Option(help="Requests per second (inf: all at once).")] = float("inf"),
    burstiness: Annotated[float, typer.Option(help="Gamma shape of the arrival intervals; 1 is Poisson.")] = 1.0,
    max_concurrency: Annotated[Optional[int], typer.Option(help="Most requests in flight.")] = None,
    percentile_metrics: Annotated[str, typer.Option(help="Any of ttft,tpot,itl,e2el.")] = "ttft,tpot,itl,e2el",
    metric_percentiles: Annotated[str, typer.Option(help="Percentiles to report, e.g. 50,90,99.")] = "99",
    save_result: SaveOpt = None, baseline: BaselineOpt = "none", hf_batch_sizes: HfBatchOpt = "8,16,32",
    hf_dtypes: HfDtypesOpt = "float32,bfloat16", progress: ProgressOpt = True,
    url: UrlOpt = None, api_key: ApiKeyOpt = None,
    in_process: Annotated[bool, typer.Option(
        "--in-process", help="Send the requests straight to AsyncLLM in this process (no HTTP).")] = False,
    label: Annotated[Optional[str], typer.Option(help="A label saved with the result.")] = None,
    save_trace: Annotated[Optional[str], typer.Option(
        "--save-trace", help="Write the requests sent as a Mooncake-style JSONL trace (arrival ms, input and "
                             "output lengths, prompt block hash ids) for --replay-trace.")] = None,
    replay_trace: Annotated[Optional[str], typer.Option(
        "--replay-trace", help="Send a JSONL trace's requests (Mooncake's keys) at its recorded pace, with its "
                               "lengths and shared prefixes, instead of the dataset and --request-rate.")] = None,
) -> None:
    """Online serving: TTFT, TPOT, ITL and E2EL under a request rate, over HTTP like `vllm bench serve`.

    --url measures a running OpenAI-compatible server; without it, `lmc serve` is started on a free
    port with the engine flags given here; --in-process measures AsyncLLM without HTTP.
    """
    from lm_console.bench.runner import Workload, bench_serve

    refuse_local_flags(ctx, url, allowed=frozenset({"model"}))  # --model: the name sent in requests
    if burstiness <= 0:
        raise typer.BadParameter("--burstiness must be > 0")
    metrics = [m.strip() for m in percentile_metrics.split(",") if m.strip()]
    unknown = sorted(set(metrics) - {"ttft", "tpot", "itl", "e2el"})
    if unknown:
        raise typer.BadParameter(f"--percentile-metrics: unknown {unknown}; allowed: ttft,tpot,itl,e2el")
    workload = Workload(dataset_name, num_prompts, random_input_len, random_output_len, random_range_ratio,
                        prefix_len, suffix_len, num_prefixes, seed)
    args = dict(engine_kwargs)
    hf = _baseline(baseline, hf_batch_sizes, hf_dtypes)
    percentiles = [float(p) for p in metric_percentiles.split(",")]
    if max_concurrency is not None and max_concurrency < 1:
        raise typer.BadParameter("--max-concurrency must be >= 1")
    replay = None
    if replay_trace is not None:
        from lm_console.bench.trace import TraceError, load_trace

        try:
            replay = load_trace(replay_trace)
        except TraceError as error:
            raise typer.BadParameter(str(error)) from None
    if in_process:
        if save_trace is not None or replay is not None:
            raise typer.BadParameter("--save-trace and --replay-trace go over HTTP; drop --in-process.")
        if url is not None:
            raise typer.BadParameter("--in-process measures this process's engine; --url a server. Pick one.")
        _finish(lambda: bench_serve(model, args, workload, hf, save_result, request_rate, burstiness,
                                    max_concurrency, metrics, percentiles, progress))
        return
    if hf.kind != "none":
        raise typer.BadParameter("--baseline hf needs --in-process (the baseline runs the same model locally).")
    from lm_console.bench.http import bench_serve_http

    def over_http() -> int:
        if url is not None:
            return bench_serve_http(url, api_key, model, workload, save_result, request_rate, burstiness,
                                    max_concurrency, metrics, percentiles, progress, label, save_trace, replay)
        from lm_console.bench.launcher import ServeProcess, free_port, serve_command

        port = free_port()
        with ServeProcess(serve_command(model, port, args), port, api_key) as server_url:
            return bench_serve_http(server_url, api_key, None, workload, save_result, request_rate, burstiness,
                                    max_concurrency, metrics, percentiles, progress, label, save_trace, replay)

    _finish(over_http)


@bench_app.command()
@engine_flags(exclude=("enable_prefix_caching",))  # it runs both
def prefix(
    engine_kwargs: dict[str, Any],
    model: ModelOpt = None,
    num_prompts: NumPromptsOpt = 64, prefix_len: PrefixLenOpt = 256, suffix_len: SuffixLenOpt = 32,
    num_prefixes: NumPrefixesOpt = 4, output_len: OutputLenOpt = 32, seed: SeedOpt = 0,
    save_result: SaveOpt = None, baseline: BaselineOpt = "none", hf_batch_sizes: HfBatchOpt = "8,16,32",
    hf_dtypes: HfDtypesOpt = "float32,bfloat16", progress: ProgressOpt = True,
) -> None:
    """The same shared-prefix prompts with prefix caching on and off."""
    from lm_console.bench.runner import Workload, bench_prefix

    workload = Workload("prefix", num_prompts, random_output_len=output_len, prefix_len=prefix_len,
                        suffix_len=suffix_len, num_prefixes=num_prefixes, seed=seed)
    args = dict(engine_kwargs)
    hf = _baseline(baseline, hf_batch_sizes, hf_dtypes)
    _finish(lambda: bench_prefix(model, args, workload, hf, save_result, progress))


PromptLenOpt = Annotated[int, typer.Option(help="Tokens of the repeated prompt.")]
ChunkSizeOpt = Annotated[int, typer.Option("--kv-chunk-size", help="Tokens per offloaded chunk.")]
DiskPathOpt = Annotated[Optional[str], typer.Option("--kv-offload-disk", help="Disk tier directory (default: temporary).")]


@bench_app.command()
@engine_flags(only=("dtype", "block_size", "num_threads"))
def offload(
    engine_kwargs: dict[str, Any],
    model: ModelOpt = None, prompt_len: PromptLenOpt = 2048, kv_chunk_size: ChunkSizeOpt = 256,
    kv_offload_disk: DiskPathOpt = None, seed: SeedOpt = 0, save_result: SaveOpt = None,
) -> None:
    """TTFT of a repeated prompt after prefix-cache eviction: recompute vs CPU tier vs disk tier (restart)."""
    from lm_console.bench.offload import bench_offload, offload_lines

    args = dict(engine_kwargs)

    def run() -> int:
        results = bench_offload(model, args, prompt_len, kv_chunk_size, kv_offload_disk, seed)
        typer.echo("\n".join(offload_lines(results)))
        if save_result:
            import json

            with open(save_result, "w") as f:
                json.dump(results, f, indent=2)
        return 0 if results["same_tokens"] else 1

    _finish(run)


@bench_app.command()
@engine_flags(only=("dtype", "num_threads", "liveness_timeout_s"))
def pd(
    engine_kwargs: dict[str, Any],
    model: ModelOpt = None,
    prompt_len: PromptLenOpt = 1024, output_len: OutputLenOpt = 16, kv_chunk_size: ChunkSizeOpt = 256,
    kv_offload_disk: DiskPathOpt = None, seed: SeedOpt = 0,
) -> None:
    """Prefill/decode disaggregation: a producer engine prefills, a consumer engine loads and decodes."""
    from lm_console.bench.offload import bench_pd, pd_lines

    args = dict(engine_kwargs)

    def run() -> int:
        result = bench_pd(model, args, prompt_len, output_len, kv_offload_disk, kv_chunk_size, seed)
        typer.echo("\n".join(pd_lines(result)))
        return 0 if result["same_tokens"] else 1

    _finish(run)
