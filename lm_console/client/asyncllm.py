"""AsyncLLMConsoleClient: the ConsoleClient over the engine's AsyncLLM (core in a child process).

The engine is imported only in start(), so importing this module costs no torch; the adapter
converts the engine's SchedulerStats, KV events and RequestOutputs into the console's types.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from lm_console.client.types import (
    EncoderCacheSample, EngineInfo, EngineUnavailable, GenParams, KVEventRecord, KVTierSample, StatsSample,
    StreamChunk,
)

_DEAD_HINT = ("The engine core process stopped (its log is below). Restart the console "
              "(`lmc tui`). If it ran out of memory, lower --num-blocks or --max-num-seqs.")
_START_HINT = ("Check the model with `lmc models` / `lmc models path MODEL`, and the engine "
               "flags (`lmc tui --help`).")


class AsyncLLMConsoleClient:
    """ConsoleClient backed by `engine.AsyncLLM(model, **engine_args)`."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.model = model
        self.engine_args = {"enable_kv_cache_events": True, **engine_args}
        self.info = EngineInfo(model=model or "SmolLM2-135M-Instruct")
        self.llm: Any = None
        self.tokenizer: Any = None

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> EngineInfo:
        try:
            _start_resource_tracker()
            # Heavy (torch, transformers, model load): off the event loop, so the UI stays live.
            module = await asyncio.to_thread(importlib.import_module, "engine.frontend.async_llm")
            # stat_loggers=[]: the dashboard shows the stats; log lines would scribble on it.
            self.llm = await asyncio.to_thread(module.AsyncLLM, self.model, stat_loggers=[], **self.engine_args)
            self.tokenizer = self.llm.get_tokenizer()
            summary = dict(getattr(self.llm, "model_config_summary", None) or {})
        except Exception as error:  # noqa: BLE001 - every start failure becomes a panel
            raise EngineUnavailable(f"{type(error).__name__}: {error}", _START_HINT,
                                    during_start=True) from error
        self.info = EngineInfo(
            model=str(summary.get("model") or self.info.model),
            device=str(summary.get("device", "cpu")), dtype=str(summary.get("dtype", "?")).replace("torch.", ""),
            block_size=int(summary.get("block_size", 16)), num_blocks=int(summary.get("num_blocks", 0)),
            max_model_len=int(summary.get("max_model_len", 0)),
            max_num_batched_tokens=int(summary.get("max_num_batched_tokens", 0)),
            max_num_seqs=int(summary.get("max_num_seqs", 0)),
            vocab_size=min(int(summary.get("vocab_size") or 1 << 30), len(self.tokenizer)),
            multimodal=bool(summary.get("multimodal", False)),
            notice=_model_notice(summary.get("model_dir")),
        )
        return self.info

    async def shutdown(self) -> None:
        if self.llm is not None:
            llm, self.llm = self.llm, None
            await asyncio.to_thread(llm.shutdown)

    # -- streams --------------------------------------------------------------------------
    async def stats_stream(self) -> AsyncIterator[StatsSample]:
        with _dead_as_unavailable(self):
            async for stats in self._engine().stats_stream():
                yield stats_sample_of(stats)

    async def kv_events_stream(self) -> AsyncIterator[list[KVEventRecord]]:
        with _dead_as_unavailable(self):
            async for batch in self._engine().kv_events_stream():
                yield kv_records_of(batch)

    async def generate(self, prompt: str | list[int], params: GenParams,
                       request_id: str) -> AsyncIterator[StreamChunk]:
        engine_prompt: Any = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
        async for chunk in self._stream(engine_prompt, params, request_id):
            yield chunk

    async def _stream(self, engine_prompt: Any, params: GenParams, request_id: str) -> AsyncIterator[StreamChunk]:
        from engine.sampling_params import RequestOutputKind, SamplingParams

        sampling = SamplingParams(
            temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
            seed=params.seed, ignore_eos=params.ignore_eos, output_kind=RequestOutputKind.DELTA,
        )
        with _dead_as_unavailable(self):
            async for output in self._engine().generate(engine_prompt, sampling, request_id=request_id):
                yield chunk_of(output)

    async def chat(self, messages: list[dict[str, Any]], params: GenParams,
                   request_id: str) -> AsyncIterator[StreamChunk]:
        from engine.multimodal.chat import build_chat_prompt

        # Images ride as content parts; the prompt builder renders the model's chat template.
        processor = self._engine().input_processor
        prompt = build_chat_prompt(self.tokenizer, processor.mm_processor, messages,
                                   check_text=processor.check_prompt_text)  # too long: refused untokenised
        async for chunk in self._stream(prompt, params, request_id):
            yield chunk

    async def abort(self, request_id: str) -> None:
        with _dead_as_unavailable(self):
            await self._engine().abort(request_id)

    async def reset_prefix_cache(self) -> bool:
        with _dead_as_unavailable(self):
            return bool(await self._engine().reset_prefix_cache())

    @property
    def kv_events_endpoint(self) -> str | None:
        return getattr(self.llm, "kv_events_endpoint", None)

    def _engine(self) -> Any:
        if self.llm is None:
            raise EngineUnavailable("The engine is not running.", _DEAD_HINT)
        if getattr(self.llm, "errored", False):
            raise EngineUnavailable(str(getattr(self.llm, "dead_error", "engine dead")), _DEAD_HINT)
        return self.llm


def _start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker with a real stderr.

    It hands sys.stderr.fileno() to its child; inside a Textual app sys.stderr is a capture
    object whose fileno() is -1, which makes the engine's process start fail.
    """
    from multiprocessing import resource_tracker

    saved = sys.stderr
    try:
        valid = saved is not None and saved.fileno() >= 0
    except (AttributeError, OSError, ValueError):
        valid = False
    if not valid:
        sys.stderr = os.fdopen(2, "w", closefd=False)
    try:
        resource_tracker.ensure_running()
    finally:
        sys.stderr = saved


class _dead_as_unavailable:
    """Context manager: the engine's EngineDeadError becomes EngineUnavailable."""

    def __init__(self, client: AsyncLLMConsoleClient) -> None:
        self.client = client

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        # Any EngineDeadError, EngineUnresponsiveError (a missed heartbeat) included.
        if exc is not None and any(cls.__name__ == "EngineDeadError" for cls in type(exc).__mro__):
            raise EngineUnavailable(str(exc) or "The engine core died.", _DEAD_HINT) from exc
        return False


# -- conversions (pure functions, tested with stand-in objects) -----------------------------
def stats_sample_of(stats: Any) -> StatsSample:
    """Convert the engine's SchedulerStats (duck-typed) into a StatsSample."""
    prefix = getattr(stats, "prefix_cache", None)
    get = lambda name, default=0: getattr(stats, name, default)  # noqa: E731
    return StatsSample(
        ts=time.time(),  # arrival here: the rate windows measure what the console has seen
        num_running_reqs=get("num_running_reqs"), num_waiting_reqs=get("num_waiting_reqs"),
        num_preempted_reqs=get("num_preempted_reqs"), num_preemptions_total=get("num_preemptions_total", None),
        num_scheduled_tokens=get("num_scheduled_tokens"),
        token_budget=get("token_budget"), kv_cache_usage=float(get("kv_cache_usage", 0.0)),
        num_free_blocks=get("num_free_blocks"), num_total_blocks=get("num_total_blocks"),
        prefix_requests=getattr(prefix, "requests", 0), prefix_queries=getattr(prefix, "queries", 0),
        prefix_hits=getattr(prefix, "hits", 0), step_time_s=float(get("step_time_s", 0.0)),
        num_steps=get("num_steps"), num_prompt_tokens=get("num_prompt_tokens", None),
        num_generation_tokens=get("num_generation_tokens", None),
        block_states=_as_bytes(get("block_states", None)),
        block_ref_counts=_as_bytes(get("block_ref_counts", None)),
        encoder_cache=encoder_cache_sample_of(get("encoder_cache", None)),
        kv_tiers=kv_tiers_of(get("kv_tiers", None)),
    )


def encoder_cache_sample_of(stats: Any) -> EncoderCacheSample | None:
    """Convert the engine's EncoderCacheStats (duck-typed); None for a text-only engine."""
    if stats is None:
        return None
    return EncoderCacheSample(**{name: int(getattr(stats, name, 0) or 0)
                                 for name in EncoderCacheSample.__dataclass_fields__})


def _model_notice(model_dir: Any) -> str | None:
    """The demo VLM's caveat, read from the marker file its builder writes."""
    import json
    from pathlib import Path

    if not model_dir:
        return None
    marker = Path(str(model_dir)) / "lmc_demo.json"
    try:
        return str(json.loads(marker.read_text()).get("label")) if marker.is_file() else None
    except (OSError, ValueError):
        return None


def kv_tiers_of(tiers: Any) -> list[KVTierSample] | None:
    """Convert the engine's KVTierStats list (duck-typed); None when there is none."""
    if not tiers:
        return None
    names = ("capacity_bytes", "used_bytes", "num_chunks", "hits", "misses", "bytes_in", "bytes_out",
             "evictions", "errors")
    return [KVTierSample(str(getattr(t, "medium", "?")), *(int(getattr(t, n, 0) or 0) for n in names))
            for t in tiers]


def kv_records_of(batch: Any) -> list[KVEventRecord]:
    """Convert one KVEventBatch (ts, events) into KVEventRecords."""
    ts = float(getattr(batch, "ts", None) or time.time())
    records = []
    for event in getattr(batch, "events", batch):
        hashes = [hash_hex(h) for h in getattr(event, "block_hashes", None) or []]
        parent = getattr(event, "parent_block_hash", None)
        records.append(KVEventRecord(
            ts=ts, kind=type(event).__name__, block_hashes=hashes,
            parent_block_hash=None if parent is None else hash_hex(parent),
            num_tokens=len(getattr(event, "token_ids", None) or []),
            block_size=int(getattr(event, "block_size", 0) or 0), medium=getattr(event, "medium", None),
        ))
    return records


def chunk_of(output: Any) -> StreamChunk:
    """Convert one DELTA RequestOutput into a StreamChunk."""
    completion = output.outputs[0] if output.outputs else None
    metrics = getattr(output, "metrics", None)
    return StreamChunk(
        request_id=output.request_id, text=completion.text if completion else "",
        num_new_tokens=len(completion.token_ids) if completion else 0,
        num_prompt_tokens=len(output.prompt_token_ids or []),
        num_cached_tokens=int(getattr(output, "num_cached_tokens", 0) or 0),
        finished=bool(output.finished),
        finish_reason=str(completion.finish_reason) if completion and completion.finish_reason else None,
        ttft_s=getattr(metrics, "time_to_first_token", None),
        tpot_s=getattr(metrics, "time_per_output_token", None),
        e2e_s=getattr(metrics, "e2e_latency", None),
    )


def hash_hex(block_hash: Any) -> str:
    """A block hash (bytes or int) as hex."""
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        return bytes(block_hash).hex()
    if isinstance(block_hash, int):
        return format(block_hash & (2**64 - 1), "016x")
    return str(block_hash)


def _as_bytes(value: Any) -> bytes | None:
    if value is None:
        return None
    return value if isinstance(value, bytes) else bytes(value)
