"""LLM: the synchronous offline entrypoint, vLLM-compatible (after vLLM's vllm/entrypoints/llm.py)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm_console.engine.config.engine_args import EngineArgs
from lm_console.engine.config.engine_config import EngineConfig
from lm_console.engine.errors import (
    EngineDeadError, InvalidLoRARequestError, InvalidPromptError, InvalidSamplingParamsError, fresh_error,
)
from lm_console.engine.frontend.beam_search import BeamSearchOutput, BeamSearchParams
from lm_console.engine.frontend.core_client import EngineCoreClient
from lm_console.engine.frontend.client_factory import make_client
from lm_console.engine.frontend.input_processor import InputProcessor, PromptType, lora_admission, make_mm_processor
from lm_console.engine.frontend.output_processor import OutputProcessor
from lm_console.engine.frontend.tracing import make_tracer
from lm_console.engine.frontend.tokenizer import (
    is_plain_fast_tokenizer,
    load_tokenizer,
    preload_tokenizer_modules,
    stop_token_ids_of,
)
from lm_console.engine.lora.request import LoRARequest
from lm_console.engine.outputs import EmbeddingRequestOutput, RequestOutput
from lm_console.engine.sampling_params import PoolingParams, RequestOutputKind, SamplingParams
from lm_console.engine.startup_trace import mark

if TYPE_CHECKING:
    from lm_console.engine.metrics.stats import BlockPoolState, RequestBlocksState, SchedulerStats

ChatMessages = list[dict[str, Any]]


class LLM:
    """Offline batched generation: `LLM(model=None, **engine_args).generate(prompts, params)`.

    model=None runs the embedded default (SmolLM2-135M-Instruct); any local HF-format
    directory or .gguf file works too. engine_args are EngineArgs fields. The engine core runs
    in its own process (SyncMPClient) unless multiprocess=False (InprocClient).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine_args = EngineArgs.from_kwargs(model, **engine_args)
        # Refused before the engine core starts (a bad URL, OpenTelemetry not installed).
        observability = self.engine_args.create_observability_config()
        mark("engine_args")
        # The tokenizer code imports while the engine core process starts; with the core in
        # this process, a plain tokenizer.json loads on a thread while the weights load (their
        # copies and packing run in torch, without the GIL).
        tokenizer_load: list[Future[Any]] = []
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmc-tokenizer") as pool:

            def load_tokenizer_meanwhile(config: EngineConfig) -> None:
                if is_plain_fast_tokenizer(config.model_config.tokenizer_dir):
                    tokenizer_load.append(pool.submit(load_tokenizer, config.model_config.tokenizer_dir))

            self.engine_core: EngineCoreClient
            self.engine_core, self.config = make_client(
                self.engine_args, while_starting=preload_tokenizer_modules, on_config=load_tokenizer_meanwhile)
            mark("engine_core")
            self.tokenizer = None
            if tokenizer_load:
                try:
                    self.tokenizer = tokenizer_load[0].result()
                except (ImportError, RuntimeError):
                    # Two threads importing at once can meet on an import cycle (CPython raises
                    # its _DeadlockError, a RuntimeError, in one of them, or an ImportError of a
                    # partly initialised module): load again here, alone; a real error repeats.
                    pass
            if self.tokenizer is None:
                self.tokenizer = load_tokenizer(self.config.model_config.tokenizer_dir)
        mark("tokenizer")
        eos_token_id, extra_stop_ids = stop_token_ids_of(Path(self.config.model_config.model_dir), self.tokenizer)
        self.input_processor = InputProcessor(
            self.tokenizer, self.config.model_config.max_model_len, self.config.model_config.vocab_size,
            eos_token_id, extra_stop_ids, mm_processor=make_mm_processor(self.config),
            max_logprobs=self.engine_args.max_logprobs,
            scheduling_policy=self.config.scheduler_config.policy,
            lora=lora_admission(self.config),
        )
        self.output_processor = OutputProcessor(self.tokenizer, tracer=make_tracer(observability))
        self._request_counter = itertools.count()
        self._marked_first_token = False

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def kv_events_endpoint(self) -> str | None:
        """The engine core's KV events PUB address (multiprocess with enable_kv_cache_events)."""
        ready_info = getattr(self.engine_core, "ready_info", None)
        return ready_info.kv_events_endpoint if ready_info is not None else None

    @property
    def kv_events_server_key(self) -> str | None:
        """The CURVE public key a subscriber needs for a tcp KV events endpoint (None for ipc)."""
        ready_info = getattr(self.engine_core, "ready_info", None)
        return ready_info.kv_events_server_key if ready_info is not None else None

    # -- generation -----------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        lora_request: the LoRA adapter every prompt runs with, or a list with one (or None, the
        base model) per prompt (vLLM's form); needs enable_lora=True.

        priority: one int per prompt (vLLM's form), used with scheduling_policy="priority"
        (a lower value is scheduled first); any value but 0 is refused under "fcfs".

        Every prompt is validated before any runs: a bad one raises its engine.errors exception
        (InvalidPromptError, InvalidSamplingParamsError, ...) and nothing is generated.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise InvalidPromptError(
                f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}.")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            if not isinstance(sampling_params, Sequence) or isinstance(sampling_params, (str, bytes)):
                raise InvalidSamplingParamsError(
                    "sampling_params must be a SamplingParams, a list with one per prompt, or None; got "
                    f"{type(sampling_params).__name__}.")
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidSamplingParamsError(
                    f"Got {len(params_list)} SamplingParams for {len(prompts)} prompts: pass one "
                    "SamplingParams, or a list with exactly one per prompt."
                )
        if priority is None:
            priorities: list[int] = [0] * len(prompts)
        elif not isinstance(priority, Sequence) or len(priority) != len(prompts):
            from lm_console.engine.errors import InvalidPriorityError

            raise InvalidPriorityError(f"priority must be a list with one int per prompt ({len(prompts)}), got "
                                       f"{type(priority).__name__}.")
        else:
            priorities = list(priority)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_requests: list[LoRARequest | None] = [lora_request] * len(prompts)
        elif isinstance(lora_request, Sequence) and not isinstance(lora_request, (str, bytes)) \
                and len(lora_request) == len(prompts):
            lora_requests = list(lora_request)
        else:
            raise InvalidLoRARequestError(
                f"lora_request must be a LoRARequest, None, or a list with one (or None) per prompt ({len(prompts)}); "
                f"got {type(lora_request).__name__}.")
        # Validate everything first, so a bad prompt is rejected before any request runs.
        processed = [self._process(prompt, params, prio, lora)
                     for prompt, params, prio, lora in zip(prompts, params_list, priorities, lora_requests)]
        request_ids: list[str] = []
        engine_requests = []
        try:
            for request_id, children in processed:
                self.output_processor.add_requests(children)
                request_ids.append(request_id)
                engine_requests.extend(request for _, request, _, _ in children)
            self.input_processor.finalize_for_send(engine_requests)
            # One message: the core admits the whole batch before its first step, as in-process.
            self.engine_core.add_requests(engine_requests)
        except BaseException:  # e.g. the in-process core rejected one: forget the whole batch
            self._abort_all()
            raise
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | list[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one or more OpenAI-style conversations via the chat template
        (lora_request as in generate)."""
        if not isinstance(messages, list) or not messages:
            raise InvalidPromptError("messages must be a non-empty list of {'role', 'content'} dicts "
                                     "(or a list of such lists).")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        from lm_console.engine.multimodal.chat import build_chat_prompt

        prompts: list[PromptType] = [
            build_chat_prompt(self.tokenizer, self.input_processor.mm_processor, conversation,
                              add_generation_prompt, chat_template_kwargs,
                              check_text=self.input_processor.check_prompt_text)
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search (vLLM's LLM.beam_search): params.beam_width sequences per prompt, best first.

        Each step generates one token for every live beam of every prompt in one batch, with the
        2 x beam_width most likely next tokens' logprobs (so beam_width <= max_logprobs / 2).
        Stop tokens are the model's EOS and end-of-turn tokens. Prompts: a str, {"prompt": str}
        or {"prompt_token_ids": [...]}, or a list of them.
        """
        from lm_console.engine.frontend.beam_search import candidates_of, start_searches

        if not isinstance(params, BeamSearchParams):
            raise InvalidSamplingParamsError(f"params must be a BeamSearchParams, got {type(params).__name__}.")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        searches = start_searches(self.input_processor, list(prompts), params)
        step = params.step_params()
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=params.max_tokens, desc="Beam search steps", dynamic_ncols=True)
        try:
            while True:
                pending = [search.pending() for search in searches]
                batch = [{"prompt_token_ids": tokens} for beams in pending for tokens in beams]
                if not batch:
                    break
                outputs = iter(self.generate(batch, step, use_tqdm=False))
                for search, beams in zip(searches, pending):
                    if beams:
                        search.advance([candidates_of(next(outputs)) for _ in beams])
                if progress is not None:
                    progress.update(1)
        finally:
            if progress is not None:
                progress.close()
        skip, tokenizer = params.skip_special_tokens, self.tokenizer
        assert tokenizer is not None  # loaded in __init__
        return [search.result(lambda ids: tokenizer.decode(ids, skip_special_tokens=skip)) for search in searches]
    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of every prompt (in input order): the model's last hidden states
        (before the LM head) pooled as pooling_params says (default: LAST, L2-normalised).

        Each prompt runs as a request of one step past its prefill (the sampled token is
        discarded); MEAN pooling skips the prefix cache, since it needs every token's state.
        """
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling_params or PoolingParams(),
                                output_kind=RequestOutputKind.FINAL_ONLY)
        return [EmbeddingRequestOutput.from_request_output(output)
                for output in self.generate(prompts, params, use_tqdm=use_tqdm)]

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        """The engine core's current gauges (running, waiting, KV usage, preemptions, ...)."""
        return self.engine_core.get_stats()

    def get_block_pool_state(self) -> BlockPoolState:
        """Block counts and the per-block state map of the KV cache."""
        return self.engine_core.get_block_pool_state()

    def get_request_blocks(self, block_ids: list[int] | None = None) -> RequestBlocksState:
        """Unfinished requests with their status, preemptions and block ids, and those blocks' hashes."""
        return self.engine_core.call_utility("get_request_blocks", block_ids)

    def check_health(self) -> None:
        """Raise the engine's EngineDeadError (or EngineUnresponsiveError) if it is gone."""
        dead_error = getattr(self.engine_core, "dead_error", None)
        if dead_error is not None:
            raise fresh_error(dead_error)

    def shutdown(self) -> None:
        """Stop the engine core (idempotent)."""
        self.engine_core.shutdown()
        if self.output_processor.tracer is not None:
            self.output_processor.tracer.shutdown()

    # -- internals ------------------------------------------------------------------------
    def _process(self, prompt: PromptType, params: SamplingParams, priority: int = 0,  # type: ignore[no-untyped-def]
                 lora_request: LoRARequest | None = None):
        request_id = str(next(self._request_counter))
        if not isinstance(params, SamplingParams):
            raise InvalidSamplingParamsError(
                f"sampling_params must be SamplingParams, got {type(params).__name__}.")
        # The offline API returns only finished outputs.
        params = params.clone()
        params.output_kind = RequestOutputKind.FINAL_ONLY
        return request_id, self.input_processor.process_request(request_id, prompt, params, priority=priority,
                                                                lora_request=lora_request)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while self.output_processor.has_unfinished_requests():
                engine_outputs = self.engine_core.get_output()
                if engine_outputs.outputs and not self._marked_first_token:
                    self._marked_first_token = True  # not an environment lookup per step
                    mark("first_token")  # a cold start's end (once per process)
                request_outputs, to_abort = self.output_processor.process_outputs(engine_outputs)
                self.engine_core.abort_requests(to_abort)
                for output in request_outputs:
                    if output.finished:
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
        except BaseException:
            self._abort_all()
            raise
        finally:
            if progress is not None:
                progress.close()
        return [finished[request_id] for request_id in request_ids]

    def _abort_all(self) -> None:
        request_ids = list(self.output_processor.request_states)
        self.output_processor.abort_requests(request_ids)
        try:
            self.engine_core.abort_requests(request_ids)
        except EngineDeadError:
            pass  # nothing left to abort

