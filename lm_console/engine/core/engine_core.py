"""EngineCore: scheduler + KV cache manager + executor, one step at a time."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future

from lm_console.engine.config.engine_config import EngineConfig
from lm_console.engine.core.kv_cache.manager import KVCacheManager
from lm_console.engine.core.mm_core import EncoderOnlyKVCacheManager, MultiModalCore
from lm_console.engine.core.sched.async_scheduler import AsyncScheduler
from lm_console.engine.core.sched.scheduler import Scheduler
from lm_console.engine.errors import DuplicateRequestError, InsufficientKVCacheError, InvalidEngineArgsError
from lm_console.engine.executor.abstract import Executor
from lm_console.engine.kv_cache_hashing import get_hash_fn_by_name, get_request_block_hasher, init_none_hash
from lm_console.engine.kv_cache_interface import KVCacheConfig, get_kv_cache_config
from lm_console.engine.metrics.kv_events import KVEventBatch
from lm_console.engine.metrics.stats import BlockPoolState, RequestBlocksState, SchedulerStats
from lm_console.engine.model_runner_output import ModelRunnerOutput
from lm_console.engine.protocol import EngineCoreOutputs, EngineCoreRequest
from lm_console.engine.request import Request, RequestStatus
from lm_console.engine.scheduler_output import SchedulerOutput
from lm_console.engine.structured_output import StructuredOutputManager

# The block map (one byte a block) rides on SchedulerStats at most this often.
BLOCK_MAP_INTERVAL_S = 0.25
# A step with nothing to run but grammars compiling waits this long for one (not a busy spin).
GRAMMAR_WAIT_S = 0.02


class EngineCore:
    """The inner loop of the engine: schedule, execute, update (after vLLM's EngineCore.step)."""

    def __init__(self, config: EngineConfig) -> None:
        self.model_executor: Executor = Executor.get_class(config)(config)
        self.mm = MultiModalCore(config)
        cache, model = config.cache_config, config.model_config
        if self.mm.is_producer_only:  # an encoder-only engine allocates no KV cache
            num_blocks = 2
            self.kv_cache_manager: KVCacheManager = EncoderOnlyKVCacheManager(model.max_model_len,
                                                                             cache.block_size)
        else:
            num_blocks = self._initialize_kv_caches(config)
            self.kv_cache_manager = KVCacheManager(
                num_blocks=num_blocks,
                block_size=cache.block_size,
                max_model_len=model.max_model_len,
                enable_caching=cache.enable_prefix_caching,
                enable_kv_cache_events=cache.enable_kv_cache_events,
                kv_cache_config=self.kv_cache_config,
            )
        if cache.kv_cache_metrics:  # sampled block lifetimes into SchedulerStats (block_metrics.py)
            from lm_console.engine.core.kv_cache.block_metrics import KVCacheMetricsCollector

            self.kv_cache_manager.block_pool.metrics_collector = KVCacheMetricsCollector(cache.kv_cache_metrics_sample)
        # num_blocks is decided: the config handed on from here (connector, ready handshake) carries it.
        self.config = config = config.with_num_blocks(num_blocks)
        self.kv_connector = None
        if config.kv_transfer_config is not None:
            from lm_console.engine.distributed.kv_transfer.base import KVConnectorRole
            from lm_console.engine.distributed.kv_transfer.factory import KVConnectorFactory

            self.kv_connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER)
        async_scheduling = config.scheduler_config.async_scheduling
        if async_scheduling and (self.kv_connector is not None or config.ec_transfer_config is not None):
            raise InvalidEngineArgsError("async_scheduling=True cannot be combined with a KV or EC connector.")
        self.structured_output_manager = StructuredOutputManager(config)
        self.scheduler = (AsyncScheduler if async_scheduling else Scheduler)(
            self.kv_cache_manager,
            connector=self.kv_connector,
            max_num_seqs=config.scheduler_config.max_num_seqs,
            max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
            max_model_len=model.max_model_len,
            log_stats=config.scheduler_config.log_stats,
            encoder_scheduler=self.mm.encoder_scheduler,
            structured_output_manager=self.structured_output_manager,
            policy=config.scheduler_config.policy,
            max_loras=config.lora_config.max_loras if config.lora_config is not None else None,
            speculative_config=config.speculative_config,
        )
        hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.request_block_hasher = (
            get_request_block_hasher(cache.block_size, hash_fn) if cache.enable_prefix_caching else None
        )
        self.num_steps = 0
        # vLLM's batch queue: batches in flight, newest first, when the executor runs more
        # than one at a time (async scheduling); None keeps the plain step().
        self.batch_queue_size = self.model_executor.max_concurrent_batches
        self.batch_queue: deque[tuple[Future[None], Future[ModelRunnerOutput], SchedulerOutput]] | None = (
            deque() if self.batch_queue_size > 1 else None)
        self.is_sleeping_flag = False
        self._last_block_map_time = float("-inf")

    def _initialize_kv_caches(self, config: EngineConfig) -> int:
        """Size the KV cache from the memory budget (or the override), then allocate it.

        Sets self.kv_cache_config: the model's KV cache groups (one for full-attention models,
        several for hybrid sliding-window models) over the num_blocks blocks.
        """
        cache, max_model_len = config.cache_config, config.model_config.max_model_len
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
        else:
            num_blocks = self.model_executor.determine_num_available_blocks()
        self.kv_cache_config: KVCacheConfig = get_kv_cache_config(self.model_executor.get_kv_cache_spec(), num_blocks)
        blocks_per_request = self.kv_cache_config.max_num_blocks_per_request(
            max_model_len, config.scheduler_config.max_num_batched_tokens
        )
        # Block 0 is the null block, so one max-length request needs one more.
        if num_blocks < blocks_per_request + 1:
            block_bytes = self.model_executor.get_kv_cache_block_bytes()
            raise InsufficientKVCacheError(
                f"The KV cache holds {max(num_blocks - 1, 0)} usable blocks of {cache.block_size} "
                f"tokens, but one request of max_model_len={max_model_len} tokens needs "
                f"{blocks_per_request}. Raise kv_cache_memory to at least "
                f"{(blocks_per_request + 1) * block_bytes} bytes (or gpu_memory_utilization), "
                f"or lower max_model_len."
            )
        self.model_executor.initialize_kv_cache(num_blocks)
        return num_blocks

    # -- requests -------------------------------------------------------------------------
    def add_request(self, engine_request: EngineCoreRequest) -> None:
        """Admit a validated request into the scheduler's WAITING queue."""
        self.mm.preprocess_request(engine_request)
        request = Request(
            request_id=engine_request.request_id,
            prompt_token_ids=engine_request.prompt_token_ids,
            sampling_params=engine_request.sampling_params,
            eos_token_id=engine_request.eos_token_id,
            arrival_time=engine_request.arrival_time,
            client_index=engine_request.client_index,
            cache_salt=engine_request.cache_salt,
            mm_features=list(engine_request.mm_features or []),
            block_hasher=self.request_block_hasher,
            kv_transfer_params=(engine_request.sampling_params.extra_args or {}).get("kv_transfer_params"),
            priority=engine_request.priority,
            lora_request=engine_request.lora_request,
        )
        if request.request_id in self.scheduler.requests:
            raise DuplicateRequestError(f"Request id {request.request_id!r} is already in the engine.")
        self.mm.validate_request(request)
        self.structured_output_manager.grammar_init(request)  # WAITING_FOR_FSM while it compiles
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Whether step() would run the model or return a batch in flight (and not sleeping)."""
        return not self.is_sleeping_flag and (self.scheduler.has_unfinished_requests() or bool(self.batch_queue))

    # -- the step -------------------------------------------------------------------------
    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """schedule -> execute_model -> sample_tokens -> update_from_output."""
        if self.batch_queue is not None:
            return self.step_with_batch_queue()
        if not self.has_work():
            return {}, False
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and self.structured_output_manager.has_pending_compiles():
            self.structured_output_manager.wait_for_compiles(GRAMMAR_WAIT_S)
        self.model_executor.execute_model(scheduler_output)
        model_output = self.model_executor.sample_tokens()
        assert not isinstance(model_output, Future)  # a blocking call returns the output itself
        return self._finish_step(scheduler_output, model_output, start)

    def step_with_batch_queue(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """Schedule and submit a batch without waiting for the ones in flight; return the
        oldest batch's outputs once the queue is full, or when nothing new was scheduled
        (after vLLM's step_with_batch_queue). The second element: whether a batch ran the model."""
        if not self.has_work():
            return {}, False
        start = time.perf_counter()
        batch_queue = self.batch_queue
        assert batch_queue is not None
        model_executed = False
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            exec_future = self.model_executor.execute_model(scheduler_output, non_block=True)
            sample_future = self.model_executor.sample_tokens(non_block=True)
            assert isinstance(exec_future, Future) and isinstance(sample_future, Future)
            batch_queue.appendleft((exec_future, sample_future, scheduler_output))
            model_executed = scheduler_output.total_num_scheduled_tokens > 0
            if model_executed and len(batch_queue) < self.batch_queue_size and not batch_queue[-1][1].done():
                return {}, True  # room for another batch: schedule it before waiting on this one
        exec_future, sample_future, scheduler_output = batch_queue.pop()
        exec_future.result()  # a forward pass's error surfaces here, before its sample's
        model_output = sample_future.result()
        outputs, _ = self._finish_step(scheduler_output, model_output, start)
        return outputs, model_executed

    def _finish_step(self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput,
                     start: float) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """update_from_output, then this step's stats and KV events on the outputs."""
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.num_steps += 1
        if self.config.scheduler_config.log_stats:
            stats = self.make_stats()
            stats.step_time_s = time.perf_counter() - start
            if not outputs:
                outputs = {0: EngineCoreOutputs()}
            for client_outputs in outputs.values():
                client_outputs.scheduler_stats = stats
        self.attach_kv_events(outputs)
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    # -- observability ----------------------------------------------------------------------
    def make_stats(self, force_block_map: bool = False) -> SchedulerStats:
        """This step's SchedulerStats; the block map joins at most every BLOCK_MAP_INTERVAL_S."""
        stats = self.scheduler.make_stats()
        stats.num_steps = self.num_steps
        stats.engine_index = self.config.parallel_config.data_parallel_rank
        now = time.monotonic()
        if force_block_map or now - self._last_block_map_time >= BLOCK_MAP_INTERVAL_S:
            self._last_block_map_time = now
            stats.block_states = self.kv_cache_manager.get_block_states()
            stats.block_ref_counts = self.kv_cache_manager.get_block_ref_counts()
        return stats

    def take_kv_events(self) -> KVEventBatch | None:
        """Drain the KV cache manager's events into one batch (None when there are none)."""
        events = self.kv_cache_manager.take_events()
        if self.kv_connector is not None:
            events.extend(self.kv_connector.take_events())
        if not events:
            return None
        parallel = self.config.parallel_config
        return KVEventBatch(ts=time.time(), events=events,
                            data_parallel_rank=parallel.data_parallel_rank if parallel.data_parallel_size > 1 else None)

    def attach_kv_events(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Put the pending KV cache events on client 0's outputs."""
        batch = self.take_kv_events()
        if batch is not None:
            outputs.setdefault(0, EngineCoreOutputs()).kv_events = batch

    # -- utility calls (also reachable over the wire, see EngineCoreProc) -------------------
    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        """The current gauges, without draining the per-step counters."""
        stats = self.scheduler.make_stats(drain=False)
        stats.num_steps = self.num_steps
        stats.engine_index = self.config.parallel_config.data_parallel_rank
        return stats

    def get_block_pool_state(self) -> BlockPoolState:
        """Block counts, per-block states and ref counts (cheap: O(num_blocks) bytes)."""
        pool = self.kv_cache_manager.block_pool
        return BlockPoolState(
            num_blocks=pool.num_gpu_blocks,
            num_free_blocks=pool.get_num_free_blocks(),
            num_cached_blocks=sum(1 for _ in pool.cached_block_hash_to_block.items()),
            num_running_reqs=len(self.scheduler.running),
            num_waiting_reqs=len(self.scheduler.waiting),
            block_states=pool.get_block_states(),
            block_ref_counts=pool.get_block_ref_counts(),
        )

    def get_request_blocks(self, block_ids: list[int] | None = None) -> RequestBlocksState:
        """Unfinished requests with their status, preemptions and block ids; hashes of those blocks
        (and of `block_ids`): the console's request inspector. O(blocks held), not O(pool)."""
        from lm_console.engine.core.request_blocks import snapshot_request_blocks

        return snapshot_request_blocks(self.scheduler, self.kv_cache_manager, block_ids or ())

    def get_prefix_cache_hashes(self) -> list[bytes]:
        """The block hashes in the prefix cache (debugging and KV event tests)."""
        from lm_console.engine.kv_cache_hashing import get_block_hash

        return [get_block_hash(key) for key, _ in self.kv_cache_manager.block_pool.cached_block_hash_to_block.items()]

    def flush_kv_connector(self, timeout_s: float = 30.0) -> bool:
        """Wait until the KV connector's queued stores are durable (e.g. on disk); False on timeout."""
        flush = getattr(self.kv_connector, "flush", None)
        return bool(flush(timeout_s)) if flush is not None else True

    def sleep(self, level: int = 1) -> bool:
        """Pause stepping (requests wait); level >= 1 also drops the prefix cache when idle."""
        self.is_sleeping_flag = True
        if level >= 1 and not self.scheduler.running:
            self.reset_prefix_cache()
        return True

    def wake_up(self) -> bool:
        self.is_sleeping_flag = False
        return True

    def is_sleeping(self) -> bool:
        return self.is_sleeping_flag

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.model_executor.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
