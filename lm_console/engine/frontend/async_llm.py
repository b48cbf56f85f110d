"""AsyncLLM: the asyncio entrypoint (after vLLM's vllm/v1/engine/async_llm.py).

generate() is an async generator per request; one output-handler task reads the core's
outputs, runs the OutputProcessor, and puts each RequestOutput into its request's
RequestOutputCollector. The engine core always runs in its own process (AsyncMPClient).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lm_console.engine.config.engine_args import EngineArgs
from lm_console.engine.errors import EngineDeadError, InvalidEngineArgsError, InvalidRequestIdError, fresh_error
from lm_console.engine.frontend.input_processor import InputProcessor, PromptType, lora_admission, make_mm_processor
from lm_console.engine.frontend.client_factory import make_async_client
from lm_console.engine.frontend.output_collector import Broadcast, RequestOutputCollector
from lm_console.engine.frontend.output_processor import OutputProcessor
from lm_console.engine.frontend.tracing import make_tracer
from lm_console.engine.frontend.tokenizer import load_tokenizer, preload_tokenizer_modules, stop_token_ids_of
from lm_console.engine.lora.request import LoRARequest
from lm_console.engine.metrics.kv_events import KVEventBatch
from lm_console.engine.metrics.loggers import LoggingStatLogger, StatLoggerBase
from lm_console.engine.metrics.stats import BlockPoolState, IterationStats, RequestBlocksState, SchedulerStats
from lm_console.engine.outputs import RequestOutput
from lm_console.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    """`async for out in llm.generate(prompt, params, request_id)`, many requests at once.

    Same arguments as LLM (EngineArgs fields). stat_loggers: None gives a LoggingStatLogger
    when log_stats is on; pass [] for none. Use as `async with AsyncLLM(...) as llm`, or call
    shutdown() (sync, idempotent, any thread).
    """

    def __init__(self, model: str | None = None, *, stat_loggers: list[StatLoggerBase] | None = None,
                 **engine_args: Any) -> None:
        self.engine_args = EngineArgs.from_kwargs(model, **engine_args)
        # Refused before the engine core starts (a bad URL, OpenTelemetry not installed).
        observability = self.engine_args.create_observability_config()
        # The tokenizer code imports while the engine core process starts.
        # AsyncMPClient, or AsyncDPClient for data_parallel_size > 1 (lm_console/engine/frontend/dp_client.py).
        self.engine_core = make_async_client(self.engine_args, while_starting=preload_tokenizer_modules)
        self.config = self.engine_args.create_frontend_config(self.engine_core.ready_info)
        self.tokenizer = load_tokenizer(self.config.model_config.tokenizer_dir)
        eos_token_id, extra_stop_ids = stop_token_ids_of(Path(self.config.model_config.model_dir), self.tokenizer)
        self.input_processor = InputProcessor(
            self.tokenizer, self.config.model_config.max_model_len, self.config.model_config.vocab_size,
            eos_token_id, extra_stop_ids, mm_processor=make_mm_processor(self.config),
            max_logprobs=self.engine_args.max_logprobs,
            scheduling_policy=self.config.scheduler_config.policy, lora=lora_admission(self.config))
        self.output_processor = OutputProcessor(self.tokenizer, tracer=make_tracer(observability))
        if stat_loggers is None:
            stat_loggers = [LoggingStatLogger()] if self.engine_args.log_stats else []
        self.stat_loggers = list(stat_loggers)
        for stat_logger in self.stat_loggers:
            stat_logger.log_engine_initialized()
        self._stats = Broadcast()
        self._kv_events = Broadcast()
        self._output_handler: asyncio.Task | None = None
        self._stats_logging: asyncio.Task | None = None
        self._handler_loop: asyncio.AbstractEventLoop | None = None
        self._input_executor: ThreadPoolExecutor | None = None

    # -- properties -------------------------------------------------------------------------
    @property
    def model_config_summary(self) -> dict[str, Any]:
        """What the console header shows: model, device, dtype, the KV cache's type and the
        cache/batch geometry."""
        model, cache, sched = self.config.model_config, self.config.cache_config, self.config.scheduler_config
        return {
            "model": model.model_name, "model_dir": model.model_dir, "device": self.config.device_config.device,
            "dtype": model.dtype, "block_size": cache.block_size, "num_blocks": cache.num_blocks,
            # the KV cache's element type as resolved ("auto" in a hand-made config: the model's)
            "kv_cache_dtype": model.dtype if cache.kv_cache_dtype == "auto" else cache.kv_cache_dtype,
            "max_model_len": model.max_model_len, "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_num_seqs": sched.max_num_seqs, "enable_prefix_caching": cache.enable_prefix_caching,
            "vocab_size": model.vocab_size, "kv_events_endpoint": self.kv_events_endpoint,
            "kv_events_server_key": self.engine_core.ready_info.kv_events_server_key,
            "multimodal": self.input_processor.mm_processor is not None,
        }

    @property
    def kv_events_endpoint(self) -> str | None:
        """The engine core's KV events PUB address (None unless enable_kv_cache_events)."""
        return self.engine_core.ready_info.kv_events_endpoint

    @property
    def kv_events_server_key(self) -> str | None:
        """The CURVE public key a subscriber needs for a tcp KV events endpoint (None for ipc)."""
        return self.engine_core.ready_info.kv_events_server_key

    @property
    def errored(self) -> bool:
        """True once the engine core died unexpectedly."""
        return self.engine_core.errored

    @property
    def dead_error(self) -> BaseException | None:
        return self.engine_core.dead_error if self.engine_core.errored else None

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # -- requests ---------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          cache_salt: str | None = None, priority: int = 0,
                          trace_headers: Mapping[str, str] | None = None,
                          lora_request: LoRARequest | None = None) -> RequestOutputCollector:
        """Validate and send one request (n children when n > 1); returns its collector.

        trace_headers: the caller's W3C trace context (traceparent), the parent of the request's
        span when tracing is on (otlp_traces_endpoint). lora_request: the LoRA adapter it runs
        with (None: the base model; needs enable_lora).
        """
        self._check_alive()
        self._ensure_output_handler()
        if _needs_processing(prompt):
            # Decoding images and tokenising text cost time in proportion to the input: one
            # thread does it (the multimodal processor and its cache are not shared across
            # threads), so the event loop keeps serving the other requests meanwhile.
            if self._input_executor is None:
                self._input_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmc-input")
            children = await asyncio.get_running_loop().run_in_executor(
                self._input_executor, self.input_processor.process_request, request_id, prompt, params,
                cache_salt, priority, lora_request)
        else:
            children = self.input_processor.process_request(request_id, prompt, params, cache_salt, priority,
                                                            lora_request)
        collector = RequestOutputCollector(children[0][1].sampling_params.output_kind)
        self.output_processor.add_requests(children, queue=collector, trace_headers=trace_headers)  # all or none
        try:
            requests = [request for _, request, _, _ in children]
            self.input_processor.finalize_for_send(requests)
            self.engine_core.add_requests(requests)
        except BaseException:
            self.output_processor.abort_requests([request_id])
            raise
        return collector

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, cache_salt: str | None = None, priority: int = 0,
                       trace_headers: Mapping[str, str] | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's RequestOutputs (kind per sampling_params.output_kind).

        Stopping the iteration early (break, aclose, cancellation) aborts the request and
        frees its KV blocks. cache_salt: only requests with the same salt share prefix blocks.
        priority: with scheduling_policy="priority", a lower value is scheduled first.
        trace_headers: the caller's traceparent (the parent of the request's OTLP span).
        lora_request: the LoRA adapter it runs with (None: the base model; needs enable_lora).
        """
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        params = sampling_params if sampling_params is not None else SamplingParams()
        collector = await self.add_request(request_id, prompt, params, cache_salt, priority, trace_headers,
                                           lora_request)
        finished = False
        try:
            while not finished:
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._abort_quietly(request_id)

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests; a running generate() ends with finish_reason "abort"."""
        self._check_alive()
        request_ids = [request_id] if isinstance(request_id, str) else request_id
        if not isinstance(request_ids, (list, tuple)) or not all(isinstance(i, str) for i in request_ids):
            raise InvalidRequestIdError(f"abort() takes a request id (str) or a list of them, got {request_id!r:.80}.")
        core_ids = self.output_processor.abort_requests(request_ids, emit_outputs=True)
        self.engine_core.abort_requests(core_ids)

    def abort_nowait(self, request_id: str | list[str]) -> None:
        """Abort requests without a final output; unknown ids and a dead engine are no-ops.

        Synchronous, for finally-blocks (a server whose client went away)."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        core_ids = self.output_processor.abort_requests(request_ids)
        try:
            self.engine_core.abort_requests(core_ids)
        except EngineDeadError:
            pass

    def _abort_quietly(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    # -- observability ----------------------------------------------------------------------
    def add_stat_logger(self, stat_logger: StatLoggerBase) -> None:
        """Attach one more stat logger (e.g. a server's Prometheus exporter) after start-up.

        It sees every batch of outputs from now on; its log() is not called on a timer
        unless it was given at construction.
        """
        stat_logger.log_engine_initialized()
        self.stat_loggers.append(stat_logger)

    def stats_stream(self, maxsize: int = 256) -> AsyncIterator[SchedulerStats]:
        """Every SchedulerStats the core sends; a slow subscriber loses the oldest ones."""
        self._check_alive()
        self._ensure_output_handler()
        return self._stats.subscribe(maxsize)

    def kv_events_stream(self, maxsize: int = 1024) -> AsyncIterator[KVEventBatch]:
        """Every KVEventBatch (needs enable_kv_cache_events=True); drops the oldest when full."""
        if not self.engine_args.enable_kv_cache_events:
            raise InvalidEngineArgsError("kv_events_stream() needs AsyncLLM(..., enable_kv_cache_events=True).")
        self._check_alive()
        self._ensure_output_handler()
        return self._kv_events.subscribe(maxsize)

    async def get_block_pool_state(self) -> BlockPoolState:
        return await self._call("get_block_pool_state")

    async def get_request_blocks(self, block_ids: list[int] | None = None) -> RequestBlocksState:
        """The core's unfinished requests with their block ids and those blocks' hashes (console inspector)."""
        return await self._call("get_request_blocks", block_ids)

    async def get_stats(self) -> SchedulerStats:
        return await self._call("get_stats")

    async def reset_prefix_cache(self) -> bool:
        return await self._call("reset_prefix_cache")

    async def sleep(self, level: int = 1) -> bool:
        return await self._call("sleep", level)

    async def wake_up(self) -> bool:
        return await self._call("wake_up")

    async def is_sleeping(self) -> bool:
        return await self._call("is_sleeping")

    async def check_health(self) -> None:
        """Raise EngineDeadError (EngineUnresponsiveError for a missed heartbeat) if the engine is gone."""
        self._check_alive()

    async def _call(self, method: str, *args: Any) -> Any:
        self._check_alive()
        return await self.engine_core.call_utility_async(method, *args)

    # -- lifecycle --------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine core and end every stream (idempotent, any thread)."""
        self.engine_core.shutdown()
        if self.output_processor.tracer is not None:
            self.output_processor.tracer.shutdown()
        if self._input_executor is not None:
            self._input_executor.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def _check_alive(self) -> None:
        if self.engine_core.dead_error is not None:
            raise fresh_error(self.engine_core.dead_error)

    def _ensure_output_handler(self) -> None:
        loop = asyncio.get_running_loop()
        task = self._output_handler
        if task is not None and self._handler_loop is loop and not task.done():
            return
        self._handler_loop = loop
        self._output_handler = loop.create_task(self._run_output_handler(), name="AsyncLLM.output_handler")
        if self.stat_loggers:
            self._stats_logging = loop.create_task(self._run_stats_logging(), name="AsyncLLM.stats_logging")

    async def _run_output_handler(self) -> None:
        """The one task that turns EngineCoreOutputs into RequestOutputs for every request."""
        client, processor, loggers = self.engine_core, self.output_processor, self.stat_loggers
        try:
            while True:
                outputs = await client.get_output_async()
                iteration_stats = IterationStats() if loggers else None
                _, reqs_to_abort = processor.process_outputs(outputs, iteration_stats)
                if reqs_to_abort:
                    client.abort_requests(reqs_to_abort)
                if outputs.scheduler_stats is not None:
                    self._stats.publish(outputs.scheduler_stats)
                if outputs.kv_events is not None:
                    self._kv_events.publish(outputs.kv_events)
                scheduler_stats = outputs.scheduler_stats
                if scheduler_stats is not None and loggers and self.engine_args.data_parallel_size > 1:
                    scheduler_stats = client.engine_wide_stats(scheduler_stats)  # the loggers see one engine
                for stat_logger in loggers:
                    stat_logger.record(scheduler_stats, iteration_stats)
        except EngineDeadError as error:
            processor.propagate_error(error)
            end = error if client.errored else None
            self._stats.close(end)
            self._kv_events.close(end)
        except Exception as error:  # noqa: BLE001 - a bug here must not hang every caller
            logger.exception("AsyncLLM output handler failed")
            dead = EngineDeadError(f"AsyncLLM output handler failed: {error}")
            processor.propagate_error(dead)
            self._stats.close(dead)
            self._kv_events.close(dead)
        finally:
            if self._stats_logging is not None:
                self._stats_logging.cancel()

    async def _run_stats_logging(self) -> None:
        interval = min(stat_logger.interval_s for stat_logger in self.stat_loggers)
        while True:
            await asyncio.sleep(interval)
            for stat_logger in self.stat_loggers:
                stat_logger.log()


def _needs_processing(prompt: Any) -> bool:
    """Whether turning the prompt into token ids takes work in proportion to it (images to
    decode, text to tokenise), as opposed to token ids given as they are."""
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, dict) and ("multi_modal_data" in prompt or "prompt_token_ids" not in prompt)
