"""EngineCore: scheduler + KV cache manager + executor, one step at a time (seed: 1115-1256)."""

from __future__ import annotations

import time
from collections.abc import Iterable

from engine.config import EngineConfig
from engine.core.kv_cache import KVCacheManager, get_request_block_hasher, init_none_hash
from engine.core.kv_cache.hashing import get_hash_fn_by_name
from engine.core.sched.scheduler import Scheduler
from engine.errors import InsufficientKVCacheError
from engine.executor.uniproc import UniProcExecutor
from engine.protocol import EngineCoreOutputs, EngineCoreRequest
from engine.request import Request, RequestStatus


class EngineCore:
    """The inner loop of the engine: schedule, execute, update (seed: EngineCore.step)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_executor = UniProcExecutor(config)
        num_blocks = self._initialize_kv_caches()
        config.num_blocks = num_blocks
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            enable_caching=config.enable_prefix_caching,
            enable_kv_cache_events=config.enable_kv_cache_events,
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
        )
        hash_fn = get_hash_fn_by_name(config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.request_block_hasher = (
            get_request_block_hasher(config.block_size, hash_fn) if config.enable_prefix_caching else None
        )
        self.num_steps = 0

    def _initialize_kv_caches(self) -> int:
        """Size the KV cache from the memory budget (or the override), then allocate it."""
        config = self.config
        if config.num_gpu_blocks_override is not None:
            num_blocks = config.num_gpu_blocks_override
        else:
            num_blocks = self.model_executor.determine_num_available_blocks()
        blocks_per_request = -(-config.max_model_len // config.block_size)
        # Block 0 is the null block, so one max-length request needs one more.
        if num_blocks < blocks_per_request + 1:
            block_bytes = self.model_executor.worker.get_kv_cache_block_bytes()
            raise InsufficientKVCacheError(
                f"The KV cache holds {max(num_blocks - 1, 0)} usable blocks of {config.block_size} "
                f"tokens, but one request of max_model_len={config.max_model_len} tokens needs "
                f"{blocks_per_request}. Raise kv_cache_memory to at least "
                f"{(blocks_per_request + 1) * block_bytes} bytes (or gpu_memory_utilization), "
                f"or lower max_model_len."
            )
        self.model_executor.initialize_kv_cache(num_blocks)
        return num_blocks

    # -- requests -------------------------------------------------------------------------
    def add_request(self, engine_request: EngineCoreRequest) -> None:
        """Admit a validated request into the scheduler's WAITING queue."""
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
        )
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in the engine.")
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step -------------------------------------------------------------------------
    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """schedule -> execute_model -> sample_tokens -> update_from_output."""
        if not self.scheduler.has_unfinished_requests():
            return {}, False
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        self.model_executor.execute_model(scheduler_output)
        model_output = self.model_executor.sample_tokens()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.num_steps += 1
        if self.config.log_stats:
            stats = self.scheduler.make_stats()
            stats.step_time_s = time.perf_counter() - start
            stats.num_steps = self.num_steps
            if not outputs:
                outputs = {0: EngineCoreOutputs()}
            for client_outputs in outputs.values():
                client_outputs.scheduler_stats = stats
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.model_executor.shutdown()
