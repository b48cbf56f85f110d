"""FakeExecutor: the executor interface with no model and no torch (the console's demo engine, tests).

The real EngineCore, Scheduler, KVCacheManager and BlockPool run over it unchanged. It keeps each
request's tokens as a worker would (new, cached, finished and preempted requests from the
SchedulerOutput) and "samples" a pseudo-random token that depends only on the request's key and
the token's position: outputs are reproducible and do not depend on batching, chunking or
preemption. The key is SamplingParams.seed when set, else a digest of the prompt (so one prompt
always gets one completion, as under greedy decoding), mixed with the engine's seed.
The forward pass is stood in for by a step time: a fixed part plus a part per scheduled token.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from lm_console.engine.config.cache import CacheConfig
from lm_console.engine.config.device import DeviceConfig
from lm_console.engine.config.engine_config import EngineConfig
from lm_console.engine.config.model import ModelConfig
from lm_console.engine.config.parallel import ParallelConfig
from lm_console.engine.config.scheduler import SchedulerConfig
from lm_console.engine.errors import EngineDeadError, InvalidEngineArgsError
from lm_console.engine.executor.abstract import Executor
from lm_console.engine.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, get_kv_cache_config
from lm_console.engine.model_runner_output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from lm_console.engine.protocol import LogprobsLists

if TYPE_CHECKING:
    from lm_console.engine.scheduler_output import SchedulerOutput

_DEFAULT_KV_CACHE_BYTES = 64 << 20  # without num_gpu_blocks_override or kv_cache_memory
_MASK64 = (1 << 64) - 1
_ALTERNATIVE_LOGPROB = -100.0  # the fake model is all but certain of the token it picks


@dataclass(frozen=True, slots=True)
class FakeModelConfig:
    """The fake model's facts (what its config.json would say) and the time one step takes."""

    vocab_size: int = 1 << 16
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int = 32
    max_position_embeddings: int = 4096
    kv_cache_dtype_bytes: int = 2  # bytes per cached K or V element (as float16)
    step_time_s: float = 0.0  # every step, whatever it computes
    step_time_per_token_s: float = 0.0  # plus this per scheduled token
    sleep: bool = True  # False: only report the step time (FakeExecutor.last_step_time_s)
    architectures: tuple[str, ...] = ("FakeForCausalLM",)
    model_type: str = "fake"

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @classmethod
    def of(cls, model_config: ModelConfig) -> FakeModelConfig:
        """The fake model of an engine's ModelConfig: its own for fake_engine_config's, else the same
        geometry as the real model it stands in for (no step time)."""
        if isinstance(model_config, FakeEngineModelConfig):
            return model_config.fake
        return cls(vocab_size=model_config.vocab_size, num_hidden_layers=model_config.num_layers,
                   num_attention_heads=model_config.num_attention_heads, num_key_value_heads=model_config.num_kv_heads,
                   head_dim=model_config.head_dim, max_position_embeddings=model_config.max_position_embeddings,
                   architectures=model_config.architectures)


@dataclass(frozen=True)
class FakeEngineModelConfig(ModelConfig):
    """The ModelConfig of an engine over the fake model: the facts of `fake`, which also holds the step time."""

    fake: FakeModelConfig = FakeModelConfig()

    @property
    def hf_config(self) -> FakeModelConfig:
        """There is no transformers config: the fake model's facts stand in for it."""
        return self.fake


def fake_engine_config(
    model: FakeModelConfig | None = None, *, num_blocks: int | None = 512, block_size: int = 16,
    max_model_len: int | None = None, max_num_batched_tokens: int = 256, max_num_seqs: int = 16,
    kv_cache_memory: int | None = None, enable_prefix_caching: bool = True,
    enable_kv_cache_events: bool = True, log_stats: bool = True, seed: int = 0, async_scheduling: bool = False,
) -> EngineConfig:
    """The EngineConfig of an engine over the FakeExecutor (no model directory, no torch).

    num_blocks counts the pool's blocks, the null block included (None: kv_cache_memory decides).
    """
    model = model or FakeModelConfig()
    max_model_len = max_model_len or model.max_position_embeddings
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("max_model_len", max_model_len),
                        ("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs),
                        ("kv_cache_memory", kv_cache_memory), ("vocab_size", model.vocab_size),
                        ("num_hidden_layers", model.num_hidden_layers)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise InvalidEngineArgsError(f"{name}={value!r} is invalid: it must be an integer >= 1.")
    if block_size & (block_size - 1):
        raise InvalidEngineArgsError(f"block_size={block_size} must be a power of two.")
    if max_model_len > model.max_position_embeddings:
        raise InvalidEngineArgsError(f"max_model_len={max_model_len} exceeds the fake model's "
                                     f"max_position_embeddings={model.max_position_embeddings}.")
    if model.step_time_s < 0 or model.step_time_per_token_s < 0:
        raise InvalidEngineArgsError("the fake model's step times must be >= 0 seconds.")
    model_config = FakeEngineModelConfig(
        model_name="fake-engine", model_dir="fake-engine", tokenizer_dir="fake-engine",
        architectures=model.architectures, is_multimodal=False, dtype="none", seed=seed,  # dtype: no weights
        max_model_len=max_model_len, max_position_embeddings=model.max_position_embeddings,
        vocab_size=model.vocab_size, hidden_size=model.hidden_size, num_layers=model.num_hidden_layers,
        num_attention_heads=model.num_attention_heads, num_kv_heads=model.num_key_value_heads,
        head_dim=model.head_dim, fake=model)
    return EngineConfig(
        model_config=model_config,
        cache_config=CacheConfig(
            block_size=block_size, enable_prefix_caching=enable_prefix_caching,
            prefix_caching_hash_algo="sha256",  # nothing else reads its hashes: no need for CBOR
            kv_cache_memory=kv_cache_memory, gpu_memory_utilization=1.0, num_gpu_blocks_override=num_blocks,
            enable_kv_cache_events=enable_kv_cache_events),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                         log_stats=log_stats, async_scheduling=async_scheduling),
        parallel_config=ParallelConfig(distributed_executor_backend="fake"),
        device_config=DeviceConfig(device="cpu"),
    )


def fake_token_id(key: int, position: int, vocab_size: int) -> int:
    """The token at `position` (0 = the first prompt token) of the request whose key is `key`."""
    return _splitmix64(key ^ _splitmix64(position)) % vocab_size


def request_key(engine_seed: int, seed: int | None, prompt_token_ids: list[int]) -> int:
    """A request's key: its sampling seed, or a digest of its prompt, mixed with the engine's seed."""
    if seed is not None:
        return _splitmix64(_splitmix64(engine_seed) ^ (seed & _MASK64))
    digest = hashlib.blake2b(b"".join(t.to_bytes(8, "little", signed=True) for t in prompt_token_ids),
                             digest_size=8).digest()
    return _splitmix64(engine_seed) ^ int.from_bytes(digest, "little")


def _splitmix64(x: int) -> int:
    """A 64-bit mixer (Steele et al.'s SplitMix64 finaliser): nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(slots=True)
class _FakeRequestState:
    """What the fake worker knows of one request (the real worker's CachedRequestState, minus tensors)."""

    key: int
    token_ids: list[int]  # prompt, then the tokens sampled so far
    num_computed_tokens: int
    num_logprobs: int | None


class FakeExecutor(Executor):
    """The executor methods EngineCore uses, over a model that needs no weights.

    Invariant: `requests` holds exactly the requests the scheduler has handed over and not yet
    finished or preempted; execute_model() and sample_tokens() alternate, one pair per step.
    """

    WORKER_METHODS = frozenset({"determine_num_available_blocks", "get_kv_cache_spec", "get_kv_cache_block_bytes",
                                "initialize_kv_cache", "execute_model", "sample_tokens", "check_health"})

    def _init_executor(self) -> None:
        self.model: FakeModelConfig = FakeModelConfig.of(self.config.model_config)
        self.requests: dict[str, _FakeRequestState] = {}
        self.kv_cache_config: KVCacheConfig | None = None
        self.last_step_time_s = 0.0  # the simulated forward time of the latest step
        self.num_steps = 0
        self._sample_req_ids: list[str] | None = None  # set by execute_model, taken by sample_tokens
        self._sample_rows: list[bool] = []
        self._is_shut_down = False

    # -- executor interface ---------------------------------------------------------------
    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call a worker method (or a function given the worker) on the one fake worker: this object."""
        if callable(method):
            return [method(self, *args, **(kwargs or {}))]
        if method not in self.WORKER_METHODS:
            raise AttributeError(f"the fake worker has no method {method!r}; it has {sorted(self.WORKER_METHODS)}")
        return [getattr(self, method)(*args, **(kwargs or {}))]

    def determine_num_available_blocks(self) -> int:
        """Blocks that fit kv_cache_memory (a default budget when it is unset)."""
        return (self.config.cache_config.kv_cache_memory or _DEFAULT_KV_CACHE_BYTES) // self.get_kv_cache_block_bytes()

    def get_kv_cache_block_bytes(self) -> int:
        """Bytes one block would take on a real device: K and V of every layer."""
        model = self.model
        if self.config.cache_config.kv_cache_dtype == "int8":  # int8 values and a float32 scale per row
            row_bytes = model.head_dim + 4
        else:
            row_bytes = model.head_dim * model.kv_cache_dtype_bytes
        return 2 * model.num_hidden_layers * self.config.cache_config.block_size * model.num_key_value_heads * row_bytes

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """One full-attention layer spec per layer: a single KV cache group."""
        spec = FullAttentionSpec(block_size=self.config.cache_config.block_size)
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(self.model.num_hidden_layers)}

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Lay out num_blocks blocks (nothing to allocate: the fake model reads no cache)."""
        self.kv_cache_config = get_kv_cache_config(self.get_kv_cache_spec(), num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> None | Future[None]:
        """Apply the scheduler's diffs, note which requests sample, and spend the step time
        (non_block=True: deferred until awaited, see Executor.execute_model)."""
        if non_block:
            return self._submit_deferred(self.execute_model, scheduler_output)
        self._run_deferred()
        self._check_alive()
        self._update_states(scheduler_output)
        scheduled = scheduler_output.num_scheduled_tokens
        req_ids = list(scheduled)
        # A request samples once its computed tokens reach all the tokens it has (not mid-prefill).
        self._sample_rows = [self.requests[r].num_computed_tokens + scheduled[r] >= len(self.requests[r].token_ids)
                             for r in req_ids]
        for req_id in req_ids:
            self.requests[req_id].num_computed_tokens += scheduled[req_id]
        self._sample_req_ids = req_ids
        model = self.model
        self.last_step_time_s = (model.step_time_s + model.step_time_per_token_s
                                 * scheduler_output.total_num_scheduled_tokens) if req_ids else 0.0
        if model.sleep and self.last_step_time_s > 0:
            time.sleep(self.last_step_time_s)

    def sample_tokens(self, non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """The next token of every request that finished its prefill in this step."""
        if non_block:
            return self._submit_deferred(self.sample_tokens)
        self._run_deferred()
        req_ids, self._sample_req_ids = self._sample_req_ids, None
        if not req_ids:
            return EMPTY_MODEL_RUNNER_OUTPUT
        self.num_steps += 1
        vocab_size = self.model.vocab_size
        sampled: list[list[int]] = []
        logprobs: dict[str, LogprobsLists] = {}
        for req_id, samples in zip(req_ids, self._sample_rows, strict=True):
            if not samples:
                sampled.append([])
                continue
            state = self.requests[req_id]
            position = len(state.token_ids)
            token_id = fake_token_id(state.key, position, vocab_size)
            state.token_ids.append(token_id)
            sampled.append([token_id])
            if state.num_logprobs is not None:
                logprobs[req_id] = _logprobs_of(state.key, position, token_id, state.num_logprobs, vocab_size)
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, logprobs=logprobs)

    def check_health(self) -> None:
        self._check_alive()

    def shutdown(self) -> None:
        self._is_shut_down = True
        self.requests.clear()

    # -- internals ------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._is_shut_down:
            raise EngineDeadError("the fake executor was shut down")

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.requests.pop(req_id, None)
        engine_seed = self.config.model_config.seed
        for new_req in scheduler_output.scheduled_new_reqs:
            params = new_req.sampling_params
            self.requests[new_req.req_id] = _FakeRequestState(
                key=request_key(engine_seed, params.seed, new_req.prompt_token_ids),
                token_ids=[*new_req.prompt_token_ids, *new_req.output_token_ids],
                num_computed_tokens=new_req.num_computed_tokens, num_logprobs=params.logprobs)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self.requests[req_id].num_computed_tokens = num_computed


def _logprobs_of(key: int, position: int, token_id: int, num_logprobs: int, vocab_size: int) -> LogprobsLists:
    """The sampled token with logprob 0 and rank 1, then the top num_logprobs: it first, then others."""
    others = [fake_token_id(key ^ (i + 1), position, vocab_size) for i in range(max(num_logprobs - 1, 0))]
    top_ids = [token_id, *others][:num_logprobs]
    top_logprobs = [0.0, *[_ALTERNATIVE_LOGPROB] * len(others)][:num_logprobs]
    return LogprobsLists([[token_id, *top_ids]], [[0.0, *top_logprobs]], [1])
