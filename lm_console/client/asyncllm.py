"""AsyncLLMConsoleClient: the ConsoleClient over the engine's AsyncLLM (core in a child process).

The engine's frontend is imported only in start(), so importing this module costs no torch.
Stats pass through as the engine's SchedulerStats; KV events become rows holding the engine's
event Structs; RequestOutputs become StreamChunks.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from lm_console.client.types import (
    EngineInfo, EngineUnavailable, GenParams, KVEventRecord, RequestTimeline, StatsSnapshot, StreamChunk,
)

from lm_console.client.protocol import ClientCapabilities

if TYPE_CHECKING:
    from lm_console.server_requests import ServerRequests
    from lm_console.engine.metrics.kv_events import DecodedKVEventBatch, KVEventBatch
    from lm_console.engine.metrics.stats import RequestBlocksState, SchedulerStats
    from lm_console.engine.outputs import RequestOutput

_DEAD_HINT = ("The engine core process stopped (its log is below). Restart the console "
              "(`lmc tui`). If it ran out of memory, lower --num-blocks or --max-num-seqs.")
_START_HINT = ("Check the model with `lmc models` / `lmc models path MODEL`, and the engine "
               "flags (`lmc tui --help`).")


class AsyncLLMConsoleClient:
    """ConsoleClient backed by `engine.AsyncLLM(model, **engine_args)`."""

    idle_snapshot_s = 1.0  # a quiet engine's gauges are re-read this often (stats_stream)

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.model = model
        self.engine_args = {"enable_kv_cache_events": True, **engine_args}
        self.info = EngineInfo(model=model or "SmolLM2-135M-Instruct")
        self.llm: Any = None
        self.tokenizer: Any = None
        self.num_dropped_frames = 0  # in process: nothing in between to drop frames
        self.num_kv_undecodable = 0  # the engine's own events, read with its own types
        self.server_requests: ServerRequests | None = None  # no server

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> EngineInfo:
        try:
            _start_resource_tracker()
            # Heavy (torch, transformers, model load): off the event loop, so the UI stays live.
            module = await asyncio.to_thread(importlib.import_module, "lm_console.engine.frontend.async_llm")
            # stat_loggers=[]: the dashboard shows the stats; log lines would scribble on it.
            self.llm = await asyncio.to_thread(module.AsyncLLM, self.model, stat_loggers=[], **self.engine_args)
            self.tokenizer = self.llm.get_tokenizer()
            summary = self.llm.model_config_summary
        except Exception as error:  # noqa: BLE001 - every start failure becomes a panel
            raise EngineUnavailable(f"{type(error).__name__}: {error}", _START_HINT,
                                    during_start=True) from error
        self.info = EngineInfo(
            model=summary["model"], device=summary["device"], dtype=summary["dtype"],
            kv_cache_dtype=summary.get("kv_cache_dtype"),
            block_size=summary["block_size"], num_blocks=summary["num_blocks"],
            max_model_len=summary["max_model_len"], max_num_batched_tokens=summary["max_num_batched_tokens"],
            max_num_seqs=summary["max_num_seqs"], vocab_size=min(summary["vocab_size"], len(self.tokenizer)),
            multimodal=summary["multimodal"], notice=_model_notice(summary["model_dir"]),
        )
        return self.info

    async def shutdown(self) -> None:
        if self.llm is not None:
            llm, self.llm = self.llm, None
            await asyncio.to_thread(llm.shutdown)

    # -- streams --------------------------------------------------------------------------
    async def stats_stream(self) -> AsyncIterator[SchedulerStats]:
        """The engine's stats, and a StatsSnapshot whenever it has been quiet for idle_snapshot_s.

        An idle (or sleeping) engine sends no stats: the snapshot keeps the dashboard's gauges and
        block map true to the engine at that moment (after a reset, an abort, the last step).
        """
        engine = self._engine()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for stats in engine.stats_stream():
                    queue.put_nowait(stats)
                queue.put_nowait(None)
            except BaseException as error:  # noqa: BLE001 - handed to the reader
                queue.put_nowait(error)

        task = asyncio.get_running_loop().create_task(pump())
        try:
            with _dead_as_unavailable(self):
                while True:
                    try:
                        item = await asyncio.wait_for(queue.get(), self.idle_snapshot_s)
                    except asyncio.TimeoutError:
                        item = await self.snapshot()
                    if item is None:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    yield item
        finally:
            task.cancel()

    async def snapshot(self) -> StatsSnapshot:
        """The engine's gauges and block map now (zero per-step counters: not a step)."""
        from lm_console.engine.entrypoints.console_hub import snapshot_stats

        with _dead_as_unavailable(self):
            stats = await snapshot_stats(self._engine())
        return StatsSnapshot(**{name: getattr(stats, name) for name in stats.__struct_fields__})

    async def request_blocks(self, block_ids: list[int] | None = None) -> RequestBlocksState:
        """The core's unfinished requests with their state, preemptions and block ids (the inspector)."""
        with _dead_as_unavailable(self):
            return await self._engine().get_request_blocks(block_ids)

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
        from lm_console.engine.sampling_params import RequestOutputKind, SamplingParams

        sampling = SamplingParams(
            temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
            seed=params.seed, ignore_eos=params.ignore_eos, output_kind=RequestOutputKind.DELTA,
        )
        with _dead_as_unavailable(self):
            async for output in self._engine().generate(engine_prompt, sampling, request_id=request_id):
                yield chunk_of(output)

    async def chat(self, messages: list[dict[str, Any]], params: GenParams,
                   request_id: str) -> AsyncIterator[StreamChunk]:
        from lm_console.engine.multimodal.chat import build_chat_prompt

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
    def capabilities(self) -> ClientCapabilities:
        return ClientCapabilities(request_blocks=True, decode_prompt=True)

    def decode_prompt(self, token_ids: list[int]) -> str:
        """Token ids as text (the inspector shows a load request's prompt)."""
        return str(self.tokenizer.decode(token_ids)) if self.tokenizer is not None else ""

    @property
    def kv_events_endpoint(self) -> str | None:
        return self.llm.kv_events_endpoint if self.llm is not None else None

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


# -- helpers and conversions -----------------------------------------------------------------
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


def kv_records_of(batch: KVEventBatch | DecodedKVEventBatch, seq: int = 0) -> list[KVEventRecord]:
    """The rows of one KV event batch (an engine's own, or one read leniently from another producer)."""
    return [KVEventRecord(batch.ts, event, seq) for event in batch.events]


def chunk_of(output: RequestOutput) -> StreamChunk:
    """Convert one DELTA RequestOutput into a StreamChunk."""
    completion = output.outputs[0] if output.outputs else None
    metrics = output.metrics
    timeline = None if metrics is None else RequestTimeline(
        metrics.arrival_time, metrics.queued_time, metrics.first_scheduled_time, metrics.first_token_time,
        list(metrics.preempted_times), metrics.finished_time, metrics.last_token_time)
    return StreamChunk(
        request_id=output.request_id, text=completion.text if completion else "",
        num_new_tokens=len(completion.token_ids) if completion else 0,
        num_prompt_tokens=len(output.prompt_token_ids or []),
        num_cached_tokens=output.num_cached_tokens,
        finished=output.finished,
        finish_reason=str(completion.finish_reason) if completion and completion.finish_reason else None,
        ttft_s=metrics.time_to_first_token if metrics is not None else None,
        tpot_s=metrics.time_per_output_token if metrics is not None else None,
        e2e_s=metrics.e2e_latency if metrics is not None else None, timeline=timeline,
    )
