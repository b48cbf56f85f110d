"""FakeConsoleClient: the engine's own core over a FakeExecutor, for tests, screenshots and `lmc tui --fake`."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from lm_console.engine.core.engine_core import EngineCore
from lm_console.engine.core.request_blocks import merge_request_blocks
from lm_console.engine.errors import DuplicateRequestError
from lm_console.engine.executor.fake import FakeExecutor, FakeModelConfig, fake_engine_config
from lm_console.engine.frontend.dp_router import DPRouter
from lm_console.engine.frontend.input_processor import InputProcessor
from lm_console.engine.metrics.kv_events import KVEventBatch
from lm_console.engine.metrics.stats import RequestBlocksState, SchedulerStats
from lm_console.engine.protocol import EngineCoreOutput, FinishReason
from lm_console.engine.sampling_params import RequestOutputKind, SamplingParams
from lm_console.server_requests import ServerRequests
from lm_console.client.fake_tokenizer import WordTokenizer
from lm_console.client.protocol import ClientCapabilities
from lm_console.client.types import EngineInfo, EngineUnavailable, GenParams, KVEventRecord, StreamChunk

_DEAD = object()  # queue sentinel: the engine died
# The fake model's simulated forward time: reported as the step time, never slept (the event loop
# paces the steps: step_interval with auto_step, the test's hand otherwise).
FAKE_MODEL = FakeModelConfig(vocab_size=1 << 16, step_time_s=0.012, step_time_per_token_s=0.0002, sleep=False)


def default_reply(messages: list[dict[str, Any]]) -> str:
    """The fake model's answer: it says what it is and echoes the question."""
    question = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
    if isinstance(question, list):  # content parts: the text parts
        question = " ".join(p.get("text", "") for p in question if isinstance(p, dict))
    return (f"This is the **fake engine** (no model is loaded). You asked: *{question.strip()}*. "
            "A real reply streams here token by token, with TTFT and tok/s in the footer.")


@dataclass(slots=True)
class _Stream:
    """One request's stream on the console side: its queue, its script and its timings."""

    queue: asyncio.Queue[Any]
    arrival: float
    num_prompt_tokens: int
    script: list[str] | None  # a chat's scripted reply, one word a generated token; None: token words
    num_generated: int = 0
    first_token_time: float | None = None
    finished: bool = False  # its last chunk is queued


class FakeConsoleClient:
    """A ConsoleClient over the real EngineCore, Scheduler and KVCacheManager, with no model and no torch.

    The FakeExecutor stands in for the model (reproducible pseudo-random tokens) and a WordTokenizer
    for its tokenizer; preemption, prefix hits, chunked prefill, KV events and the block map all
    come from the engine's own scheduler. It runs on the caller's event loop, timed by `clock`
    (tests move it by hand). With auto_step the engine steps every step_interval seconds while
    it has requests; without it, tests call step() (or push_stats / push_events) themselves.
    """

    num_dropped_frames = 0  # nothing in between to drop frames
    num_kv_undecodable = 0
    server_requests: ServerRequests | None = None  # no server

    def __init__(self, *, num_blocks: int = 512, block_size: int = 16, token_budget: int = 256,
                 max_num_seqs: int = 16, auto_step: bool = True, step_interval: float = 0.05,
                 clock: Callable[[], float] = time.time, fail_start: str | None = None,
                 start_delay: float = 0.0, reply: Callable[[list[dict[str, Any]]], str] = default_reply,
                 seed: int = 0, max_model_len: int | None = None, data_parallel_size: int = 1) -> None:
        if max_model_len is None:  # as long as the pool allows (the engine insists one request fits)
            max_model_len = min(FAKE_MODEL.max_position_embeddings, (num_blocks - 1) * block_size)
        config = fake_engine_config(FAKE_MODEL, num_blocks=num_blocks, block_size=block_size,
                                    max_model_len=max_model_len, max_num_batched_tokens=token_budget,
                                    max_num_seqs=max_num_seqs, seed=seed)
        # data_parallel_size > 1: that many engine cores, each tagging its stats with its index,
        # requests routed to the least loaded as lm_console/engine/frontend/dp_client.py does.
        self.cores = [EngineCore(dataclasses.replace(config, parallel_config=dataclasses.replace(
            config.parallel_config, data_parallel_size=data_parallel_size, data_parallel_rank=rank)))
            for rank in range(data_parallel_size)]
        self.core = self.cores[0]
        self.router = DPRouter(data_parallel_size)
        self._core_of: dict[str, int] = {}
        executor = self.core.model_executor
        assert isinstance(executor, FakeExecutor)
        self.executor = executor
        self.tokenizer = WordTokenizer(FAKE_MODEL.vocab_size)
        model, sched = config.model_config, config.scheduler_config
        self.input_processor = InputProcessor(self.tokenizer, model.max_model_len, FAKE_MODEL.vocab_size,
                                              eos_token_id=None)
        self.info = EngineInfo(
            model=model.model_name, device=config.device_config.device, dtype=model.dtype,
            block_size=config.cache_config.block_size, num_blocks=self.core.kv_cache_config.num_blocks,
            max_model_len=model.max_model_len, max_num_batched_tokens=sched.max_num_batched_tokens,
            max_num_seqs=sched.max_num_seqs, vocab_size=FAKE_MODEL.vocab_size,
        )
        self.reply = reply
        self._init_client_state(clock=clock, auto_step=auto_step, step_interval=step_interval,
                                fail_start=fail_start, start_delay=start_delay)

    def _init_client_state(self, *, clock: Callable[[], float], auto_step: bool, step_interval: float,
                           fail_start: str | None = None, start_delay: float = 0.0) -> None:
        """The stepping, subscription and stream state (also for the subclasses over a real
        engine or a recording, which build their own engine side)."""
        self.auto_step = auto_step
        self.step_interval = step_interval
        self.clock = clock
        self.fail_start = fail_start
        self.start_delay = start_delay
        self.dead_error: EngineUnavailable | None = None
        self.submitted: list[str] = []
        self._stats_queues: list[asyncio.Queue[Any]] = []
        self._event_queues: list[asyncio.Queue[Any]] = []
        self._streams: dict[str, _Stream] = {}
        self._num_event_batches = 0
        self._ticker: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._is_shut_down = False

    # -- ConsoleClient --------------------------------------------------------------------
    async def start(self) -> EngineInfo:
        if self.start_delay:
            await asyncio.sleep(self.start_delay)
        if self.fail_start:
            raise EngineUnavailable(self.fail_start, "Check the model path with `lmc models`.",
                                    during_start=True)
        if self.auto_step and self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        return self.info

    async def stats_stream(self) -> AsyncIterator[SchedulerStats]:
        async for item in self._subscribe(self._stats_queues):
            yield item

    async def kv_events_stream(self) -> AsyncIterator[list[KVEventRecord]]:
        async for item in self._subscribe(self._event_queues):
            yield item

    async def generate(self, prompt: str | list[int], params: GenParams,
                       request_id: str) -> AsyncIterator[StreamChunk]:
        engine_prompt: Any = {"prompt_token_ids": list(prompt)} if isinstance(prompt, list) else prompt
        async for chunk in self._run(request_id, engine_prompt, params, script=None):
            yield chunk

    async def chat(self, messages: list[dict[str, Any]], params: GenParams,
                   request_id: str) -> AsyncIterator[StreamChunk]:
        """The fake model has no language: it streams reply(messages), one word a generated token."""
        rendered = " ".join(f"<|{m['role']}|> {_text_of(m['content'])}" for m in messages)
        script = self.reply(messages).split(" ")[: params.max_tokens]
        async for chunk in self._run(request_id, rendered, params, script=script):
            yield chunk

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and not stream.finished:
            self._core_for(request_id).abort_requests([request_id])
            stream.finished = True
            stream.queue.put_nowait(self._chunk(request_id, stream, "", 0, self.clock(), "abort"))

    async def request_blocks(self, block_ids: list[int] | None = None) -> RequestBlocksState:
        """Every core's unfinished requests with their state, preemptions and block ids (the inspector),
        merged as the data-parallel client merges its cores' answers."""
        self._raise_if_dead()
        return merge_request_blocks([core.get_request_blocks(block_ids) for core in self.cores])

    @property
    def capabilities(self) -> ClientCapabilities:
        return ClientCapabilities(request_blocks=True, decode_prompt=True)

    @property
    def kv_events_endpoint(self) -> str | None:
        return None  # the events come from the in-process cores

    def decode_prompt(self, token_ids: list[int]) -> str:
        """Token ids as text (the inspector shows a load request's prompt)."""
        return str(self.tokenizer.decode(token_ids))

    async def reset_prefix_cache(self) -> bool:
        self._raise_if_dead()
        done = all([core.reset_prefix_cache() for core in self.cores])
        for core in self.cores:
            self._publish_events(core.take_kv_events(), self.clock())  # AllBlocksCleared, now
        return done

    async def shutdown(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        if not self._is_shut_down:
            self._is_shut_down = True
            for core in self.cores:
                core.shutdown()

    # -- test hooks -----------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return any(core.has_unfinished_requests() for core in self.cores)

    def step(self) -> None:
        """Run one step of every engine core (with work) and publish its stats, KV events and tokens."""
        for index in range(len(self.cores)):
            self._step_core(index)

    def _step_time_s(self, index: int) -> float:
        """The simulated compute time of core `index`'s last step (its fake executor's)."""
        return self.cores[index].model_executor.last_step_time_s

    def _step_core(self, index: int) -> None:
        if self.dead_error is not None or self._is_shut_down:
            return
        core = self.cores[index]
        outputs, _ = core.step()
        if not outputs:
            return
        now = self.clock()
        step_time_s = self._step_time_s(index)
        done = now + step_time_s  # tokens leave when the simulated compute ends
        stats: SchedulerStats | None = None
        events: KVEventBatch | None = None
        for client_outputs in outputs.values():
            self.router.observe(index, client_outputs)
            stats = client_outputs.scheduler_stats or stats
            events = client_outputs.kv_events or events
            for output in client_outputs.outputs:
                self._deliver(output, done)
        if stats is not None:
            # The fake's own time: its clock, the simulated compute, and the block map every step
            # (the core sends it a few times a second of wall time, which a hand-moved clock lacks).
            stats.timestamp = now
            stats.step_time_s = step_time_s
            if stats.block_states is None:
                stats.block_states = core.kv_cache_manager.get_block_states()
                stats.block_ref_counts = core.kv_cache_manager.get_block_ref_counts()
            self.push_stats(stats)
        self._publish_events(events, now)

    def push_stats(self, stats: SchedulerStats) -> None:
        for queue in self._stats_queues:
            queue.put_nowait(stats)

    def push_events(self, events: list[KVEventRecord]) -> None:
        for queue in self._event_queues:
            queue.put_nowait(events)

    def kill(self, message: str = "The engine core process died unexpectedly.") -> None:
        """Make the engine dead: every stream raises EngineUnavailable."""
        self.dead_error = EngineUnavailable(message, "Restart `lmc tui`; the log above the "
                                            "traceback in the engine's stderr says why it died.")
        queues = [*self._stats_queues, *self._event_queues, *(s.queue for s in self._streams.values())]
        for queue in queues:
            queue.put_nowait(_DEAD)

    # -- internals ------------------------------------------------------------------------
    async def _subscribe(self, queues: list[asyncio.Queue[Any]]) -> AsyncIterator[Any]:
        self._raise_if_dead()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        queues.append(queue)
        try:
            while True:
                item = await queue.get()
                if item is _DEAD:
                    self._raise_if_dead()
                yield item
        finally:
            queues.remove(queue)

    async def _run(self, request_id: str, prompt: Any, params: GenParams,
                   script: list[str] | None) -> AsyncIterator[StreamChunk]:
        self._raise_if_dead()
        if self._is_shut_down:
            raise EngineUnavailable("The fake engine was shut down.", "Start a new client.")
        sampling = SamplingParams(
            temperature=params.temperature, top_p=params.top_p, seed=params.seed, ignore_eos=params.ignore_eos,
            max_tokens=params.max_tokens if script is None else len(script),
            output_kind=RequestOutputKind.DELTA)
        now = self.clock()
        _, request = self.input_processor.process_inputs(request_id, prompt, sampling, arrival_time=now)
        if request_id in self._core_of:
            raise DuplicateRequestError(f"Request id {request_id!r} is already in the engine.")
        index = next(iter(self.router.assign([request])))
        try:
            self.cores[index].add_request(request)  # raises on a bad request, before any stream exists
        except BaseException:
            self.router.release([request_id])
            raise
        self._core_of[request_id] = index
        stream = _Stream(asyncio.Queue(), now, len(request.prompt_token_ids), script)
        self._streams[request_id] = stream
        self.submitted.append(request_id)
        self._wake.set()
        try:
            while True:
                chunk = await stream.queue.get()
                if chunk is _DEAD:
                    self._raise_if_dead()
                yield chunk
                if chunk.finished:
                    return
        finally:
            del self._streams[request_id]
            core = self._core_for(request_id)
            self.router.release([request_id])
            del self._core_of[request_id]
            if not self._is_shut_down:
                core.abort_requests([request_id])  # a no-op once it finished

    def _deliver(self, output: EngineCoreOutput, now: float) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None or stream.finished:
            return
        words = []
        for token_id in output.new_token_ids:
            script = stream.script
            if script is not None:
                words.append(script[stream.num_generated] if stream.num_generated < len(script) else "")
            else:
                words.append(self.tokenizer.word_of(token_id))
            stream.num_generated += 1
        if stream.first_token_time is None and words:
            stream.first_token_time = now
        text = ("" if stream.num_generated == len(words) else " ") + " ".join(words)
        finish = None if output.finish_reason is None else str(output.finish_reason)
        if output.finish_reason == FinishReason.LENGTH and stream.script is not None \
                and stream.num_generated >= len(stream.script):
            finish = "stop"  # the scripted reply ended (its length was the token limit)
        stream.finished = finish is not None
        stream.queue.put_nowait(self._chunk(output.request_id, stream, text, len(words), now, finish,
                                            output.num_cached_tokens))

    @staticmethod
    def _chunk(request_id: str, stream: _Stream, text: str, num_new: int, now: float, finish: str | None,
               num_cached_tokens: int = 0) -> StreamChunk:
        first = stream.first_token_time
        ttft = None if first is None else first - stream.arrival
        tpot = None
        if finish and first is not None and stream.num_generated > 1:
            tpot = (now - first) / (stream.num_generated - 1)
        return StreamChunk(
            request_id=request_id, text=text, num_new_tokens=num_new, num_prompt_tokens=stream.num_prompt_tokens,
            num_cached_tokens=num_cached_tokens, finished=finish is not None, finish_reason=finish,
            ttft_s=ttft, tpot_s=tpot, e2e_s=(now - stream.arrival) if finish else None,
        )

    def _publish_events(self, batch: KVEventBatch | None, now: float) -> None:
        if batch is None:
            return
        self._num_event_batches += 1
        self.push_events([KVEventRecord(now, event, self._num_event_batches) for event in batch.events])

    def _core_for(self, request_id: str) -> EngineCore:
        return self.cores[self._core_of.get(request_id, 0)]

    def _raise_if_dead(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    async def _tick(self) -> None:
        while self.dead_error is None:
            if not self.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
            try:
                self.step()
            except Exception as error:  # noqa: BLE001 - an engine failure ends every stream, visibly
                self.kill(f"The fake engine failed: {type(error).__name__}: {error}")
                return
            await asyncio.sleep(self.step_interval)


def _text_of(content: Any) -> str:
    """A message's text (content parts: the text parts; the fake model sees no images)."""
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)
