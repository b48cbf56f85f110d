"""Engine flags shared by `lmc tui`, `chat`, `events`, `bench` and `batch` (Typer annotations)."""

from __future__ import annotations

import os
from typing import Annotated, Any, Optional

import typer

ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="Model name, HF-format directory or .gguf file (default: the embedded SmolLM2-135M-Instruct).")]
DtypeOpt = Annotated[str, typer.Option(help="auto | float32 | bfloat16.")]
MaxModelLenOpt = Annotated[Optional[int], typer.Option(help="Longest prompt + output, in tokens.")]
NumBlocksOpt = Annotated[Optional[int], typer.Option(
    "--num-blocks", help="KV cache blocks (overrides the memory budget; the block map shows each).")]
BlockSizeOpt = Annotated[int, typer.Option(help="Tokens per KV block.")]
MaxNumSeqsOpt = Annotated[int, typer.Option(help="Most requests in one step.")]
MaxNumBatchedTokensOpt = Annotated[int, typer.Option(help="Token budget of one step.")]
PrefixCachingOpt = Annotated[bool, typer.Option(
    "--enable-prefix-caching/--no-enable-prefix-caching", help="Share the KV blocks of common prefixes.")]
NumThreadsOpt = Annotated[Optional[int], typer.Option(
    help="torch threads on CPU (default: all cores; tui/chat/events: all but one, which the console uses).")]
AsyncSchedulingOpt = Annotated[bool, typer.Option(
    "--async-scheduling", help="Schedule step N+1 while step N runs (placeholders for the tokens in flight).")]
SchedulingPolicyOpt = Annotated[str, typer.Option(
    help="fcfs | priority (requests' `priority`: a lower value first; it preempts lower ones).")]
KVCacheMetricsOpt = Annotated[bool, typer.Option(
    "--kv-cache-metrics/--no-kv-cache-metrics", help="Sample KV block lifetimes, idle and reuse times.")]
KVCachePrefaultOpt = Annotated[bool, typer.Option(
    "--kv-cache-prefault/--no-kv-cache-prefault",
    help="Touch every page of the CPU KV cache at start-up (steady speed from the first request; "
         "off: pages are faulted in when first written).")]
KVCacheDtypeOpt = Annotated[str, typer.Option(
    help="auto | int8 | the model's dtype. auto: int8 (half the bytes per cached token) where the weights "
         "run quantized on the CPU, the model's dtype elsewhere.")]
KVCacheMetricsSampleOpt = Annotated[float, typer.Option(help="Fraction of KV blocks sampled by --kv-cache-metrics.")]
FakeOpt = Annotated[bool, typer.Option("--fake", help="Use the built-in fake engine (no model; for demos and tests).")]
# Scaling out (docs/scaling-out.md, "Data parallelism and Ray").
TensorParallelOpt = Annotated[int, typer.Option(help="Workers per engine core, each holding a slice of the model.")]
DataParallelOpt = Annotated[int, typer.Option(
    help="Engine cores behind one frontend, each with the whole model and its own KV cache (the console: c cycles).")]
ExecutorBackendOpt = Annotated[str, typer.Option(
    help="Where a core's workers run: uni (in the core) | ray (Ray actors, across a Ray cluster).")]
DataParallelBackendOpt = Annotated[str, typer.Option(
    help="Where the --data-parallel-size engine cores run: mp (processes here) | ray (Ray actors, across a Ray cluster).")]
DataParallelRoutingOpt = Annotated[str, typer.Option(
    help="least_loaded | prefix (prefer the core holding the request's longest cached prefix).")]


DEFAULT_LIVENESS_TIMEOUT_S = 30.0  # EngineArgs.liveness_timeout_s's default
LivenessTimeoutOpt = Annotated[float, typer.Option(
    "--liveness-timeout", min=0.0,
    help="Seconds without a heartbeat from the engine core before it is declared dead (a stopped or hung "
         "core: requests then fail with EngineUnresponsiveError and `lmc serve` exits 1); 0: never.")]

EnableLoraOpt = Annotated[bool, typer.Option(
    "--enable-lora", help="Serve LoRA adapters (PEFT format) on top of the base model.")]
MaxLorasOpt = Annotated[int, typer.Option(
    "--max-loras", min=1, help="Adapters resident at once (and the most distinct adapters in one step).")]
MaxLoraRankOpt = Annotated[int, typer.Option("--max-lora-rank", min=1, help="Largest adapter rank accepted.")]
MaxCpuLorasOpt = Annotated[Optional[int], typer.Option(
    "--max-cpu-loras", min=1, help="Adapters kept in host memory, least recently used evicted (default: --max-loras).")]


def lora_args(enable_lora: bool = False, max_loras: int = 1, max_lora_rank: int = 16,
              max_cpu_loras: int | None = None) -> dict[str, Any]:
    """EngineArgs keyword arguments of the LoRA flags (defaults left out; the engine checks them)."""
    args: dict[str, Any] = {}
    if enable_lora:
        args["enable_lora"] = True
    if max_loras != 1:
        args["max_loras"] = max_loras
    if max_lora_rank != 16:
        args["max_lora_rank"] = max_lora_rank
    if max_cpu_loras is not None:
        args["max_cpu_loras"] = max_cpu_loras
    return args


def liveness_args(liveness_timeout: float = DEFAULT_LIVENESS_TIMEOUT_S) -> dict[str, Any]:
    """EngineArgs keyword arguments of --liveness-timeout ({} at the default; 0 -> None, never)."""
    if liveness_timeout == DEFAULT_LIVENESS_TIMEOUT_S:
        return {}
    return {"liveness_timeout_s": liveness_timeout or None}


def parallel_args(tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                  distributed_executor_backend: str = "uni",
                  data_parallel_routing: str = "least_loaded", data_parallel_backend: str = "mp") -> dict[str, Any]:
    """EngineArgs keyword arguments of the scale-out flags (defaults left out; the engine checks them)."""
    args: dict[str, Any] = {}
    if tensor_parallel_size != 1:
        args["tensor_parallel_size"] = tensor_parallel_size
    if data_parallel_size != 1:
        args["data_parallel_size"] = data_parallel_size
    if distributed_executor_backend != "uni":
        args["distributed_executor_backend"] = distributed_executor_backend
    if data_parallel_routing != "least_loaded":
        args["data_parallel_routing"] = data_parallel_routing
    if data_parallel_backend != "mp":
        args["data_parallel_backend"] = data_parallel_backend
    return args


def engine_args(dtype: str = "auto", max_model_len: int | None = None, num_blocks: int | None = None,
                block_size: int = 16, max_num_seqs: int = 128, max_num_batched_tokens: int = 2048,
                enable_prefix_caching: bool = True, num_threads: int | None = None,
                async_scheduling: bool = False) -> dict[str, Any]:
    """EngineArgs keyword arguments from the shared flags (unset ones left to the engine)."""
    args: dict[str, Any] = {
        "dtype": dtype, "block_size": block_size, "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens, "enable_prefix_caching": enable_prefix_caching,
    }
    if max_model_len is not None:
        args["max_model_len"] = max_model_len
    if num_blocks is not None:
        args["num_gpu_blocks_override"] = num_blocks
    if num_threads is not None:
        args["num_threads"] = num_threads
    if async_scheduling:
        args["async_scheduling"] = True
    return args


def console_threads(num_threads: int | None) -> int:
    """Engine threads when the console shares the machine: leave one core to the console.

    The console's process (tokenizer, detokenizer, rendering) needs CPU too; on a 2-core machine
    an engine with 2 threads fights it and steps slow down many times over.
    """
    if num_threads is not None:
        return num_threads
    return max((os.cpu_count() or 2) - 1, 1)


def parse_range(text: str, name: str) -> tuple[int, int]:
    """'32-192' or '64' -> (low, high); a clear error otherwise."""
    low, _, high = text.partition("-")
    try:
        pair = (int(low), int(high or low))
    except ValueError:
        raise typer.BadParameter(f"{name} must look like 32-192 or 64, got {text!r}") from None
    if not 1 <= pair[0] <= pair[1]:
        raise typer.BadParameter(f"{name} must satisfy 1 <= min <= max, got {text!r}")
    return pair
