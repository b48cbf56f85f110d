"""SteppedEngineClient: the real engine (a model, its tokenizer, EngineCore) stepped by hand.

The console's screenshots come from the real engine, reproducibly: the same scenes as the fake
engine's (lm_console/tui/demo.py) drive it step by step on a hand-moved clock, so each picture is
one function of the model, the seeds and the scene. Everything the engine decides is its own
(scheduling, prefix hits, preemption, KV events, the block map, the model's tokens and text); the
only stand-ins are times: the clock is the scene's and each step counts `step_time_s`.
"""

from __future__ import annotations

from typing import Any

from lm_console.engine.protocol import EngineCoreOutput
from lm_console.engine.metrics.stats import RequestBlocksState, SchedulerStats
from lm_console.engine.frontend.dp_router import DPRouter
from lm_console.client.fake import FakeConsoleClient
from lm_console.client.replay import Frame, Recording
from lm_console.client.types import EngineInfo, GenParams, KVEventRecord


class SteppedEngineClient(FakeConsoleClient):
    """FakeConsoleClient's stepping and streams over `engine.LLM(model, multiprocess=False)`."""

    def __init__(self, model: str | None = None, *, clock: Any, step_time_s: float = 0.05,
                 **engine_args: Any) -> None:
        from lm_console.engine.frontend.llm import LLM

        self.llm = LLM(model, multiprocess=False, enable_kv_cache_events=True, **engine_args)
        self.core = self.llm.engine_core.engine_core
        self.cores = [self.core]  # FakeConsoleClient steps every data-parallel core: here one
        self.router = DPRouter(1)
        self._core_of: dict[str, int] = {}
        self.tokenizer = self.llm.tokenizer
        self.input_processor = self.llm.input_processor
        self.step_time_s = step_time_s
        config = self.llm.config
        model_config, cache, sched = config.model_config, config.cache_config, config.scheduler_config
        from lm_console.client.asyncllm import _model_notice

        self.info = EngineInfo(
            model=model_config.model_name, device=config.device_config.device, dtype=model_config.dtype,
            block_size=cache.block_size, num_blocks=cache.num_blocks, max_model_len=model_config.max_model_len,
            max_num_batched_tokens=sched.max_num_batched_tokens, max_num_seqs=sched.max_num_seqs,
            vocab_size=min(model_config.vocab_size, len(self.tokenizer)),
            multimodal=self.input_processor.mm_processor is not None, notice=_model_notice(model_config.model_dir),
        )
        self._init_client_state(clock=clock, auto_step=False, step_interval=step_time_s)
        self._token_ids: dict[str, list[int]] = {}
        self._texts: dict[str, str] = {}  # each streaming request's text so far
        self.record: Recording | None = None  # set to record a scene (lm_console/client/replay.py)

    def start_recording(self) -> Recording:
        """Keep what the console receives from now on; returns the Recording being filled."""
        self.record = Recording(info=self.info)
        return self.record

    def step(self) -> None:
        if self.record is not None:
            self.record.frames.append(Frame())
        super().step()
        if self.record is not None:
            self.record.frames[-1].busy = self.core.has_unfinished_requests()

    def push_stats(self, stats: SchedulerStats) -> None:
        if self.record is not None and self.record.frames:
            self.record.frames[-1].stats.append(stats)
        super().push_stats(stats)

    def push_events(self, events: list[KVEventRecord]) -> None:
        if self.record is not None and self.record.frames:
            self.record.frames[-1].events.append(events)
        super().push_events(events)

    async def request_blocks(self, block_ids: list[int] | None = None) -> RequestBlocksState:
        state = self.core.get_request_blocks(block_ids)
        if self.record is not None:
            self.record.polls.append(state)
        return state

    async def chat(self, messages: list[dict[str, Any]], params: GenParams,
                   request_id: str) -> Any:
        """The model's own reply through its chat template (images too, for a vision-language model)."""
        from lm_console.engine.multimodal.chat import build_chat_prompt

        processor = self.input_processor
        prompt = build_chat_prompt(self.tokenizer, processor.mm_processor, messages,
                                   check_text=processor.check_prompt_text)
        async for chunk in self._run(request_id, prompt, params, script=None):
            yield chunk

    def _step_time_s(self, index: int) -> float:
        return self.step_time_s  # the real engine's step takes real time; the scene's clock, this

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def decode_prompt(self, token_ids: list[int]) -> str:
        """decode() for the console (the inspector), recorded."""
        text = self.decode(token_ids)
        if self.record is not None:
            self.record.decodes.append(text)
        return text

    async def shutdown(self) -> None:
        if not self._is_shut_down:
            self._is_shut_down = True
            self.llm.shutdown()

    def _deliver(self, output: EngineCoreOutput, now: float) -> None:
        """Text by decoding the request's tokens so far (the part not yet sent)."""
        stream = self._streams.get(output.request_id)
        if stream is None or stream.finished:
            return
        ids = self._token_ids.setdefault(output.request_id, [])
        before = self._texts.get(output.request_id, "")  # decode(ids) before these tokens
        ids.extend(output.new_token_ids)
        stream.num_generated += len(output.new_token_ids)
        full = self.decode(ids)
        self._texts[output.request_id] = full
        text = full[len(before):]
        if stream.first_token_time is None and output.new_token_ids:
            stream.first_token_time = now
        finish = None if output.finish_reason is None else str(output.finish_reason)
        stream.finished = finish is not None
        if stream.finished:
            self._token_ids.pop(output.request_id, None)
            self._texts.pop(output.request_id, None)
        chunk = self._chunk(output.request_id, stream, text, len(output.new_token_ids), now, finish,
                            output.num_cached_tokens)
        if self.record is not None and self.record.frames:
            self.record.frames[-1].chunks.append(chunk)
        stream.queue.put_nowait(chunk)

