"""UniProcExecutor: the worker lives in the engine-core process (seed: Executor, 1393-1558)."""

from __future__ import annotations

from typing import Any

from engine.config import EngineConfig
from engine.model_runner_output import ModelRunnerOutput
from engine.scheduler_output import SchedulerOutput
from engine.worker.worker import Worker


class UniProcExecutor:
    """collective_rpc over a single in-process Worker."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.worker = Worker(config)
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Call `method` on every worker (here: one) and return their results."""
        return [getattr(self.worker, method)(*args)]

    def determine_num_available_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_available_blocks"))

    def get_kv_cache_spec(self) -> dict[str, Any]:
        """Each attention layer's KVCacheSpec (all workers hold the same model)."""
        return self.collective_rpc("get_kv_cache_spec")[0]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.collective_rpc("execute_model", (scheduler_output,))

    def sample_tokens(self) -> ModelRunnerOutput:
        return self.collective_rpc("sample_tokens")[0]

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.worker.model_runner = None
