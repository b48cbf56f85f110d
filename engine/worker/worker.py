"""Worker: one device, one ModelRunner (seed: Executor, lines 1393-1558)."""

from __future__ import annotations

import os

import torch

from engine.config import EngineConfig
from engine.core.sched.output import SchedulerOutput
from engine.worker.model_runner import ModelRunner
from engine.worker.model_runner_output import ModelRunnerOutput

_DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


class Worker:
    """Sets up the device, loads the model, sizes and allocates the KV cache, runs steps."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        if self.config.device.type == "cpu":
            torch.set_num_threads(self.config.num_threads or os.cpu_count() or 1)
        torch.manual_seed(self.config.seed)
        self.model_runner = ModelRunner(self.config)

    def load_model(self) -> None:
        assert self.model_runner is not None
        self.model_runner.load_model()

    def determine_num_available_blocks(self) -> int:
        """Blocks that fit the KV budget: kv_cache_memory on CPU, profiled free memory on CUDA."""
        assert self.model_runner is not None
        block_bytes = self.model_runner.get_kv_cache_block_bytes()
        if self.config.device.type == "cuda":
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            used = total - free
            # Leave room for activations: the peak of a max-size batch is not profiled yet,
            # so reserve a fixed slice of the budget for it.
            budget = int(total * self.config.gpu_memory_utilization) - used
            budget -= 256 << 20
            return max(budget // block_bytes, 0)
        budget = self.config.kv_cache_memory or _DEFAULT_CPU_KV_CACHE_BYTES
        return budget // block_bytes

    def get_kv_cache_block_bytes(self) -> int:
        assert self.model_runner is not None
        return self.model_runner.get_kv_cache_block_bytes()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        assert self.model_runner is not None
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        assert self.model_runner is not None
        self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self) -> ModelRunnerOutput:
        assert self.model_runner is not None
        return self.model_runner.sample_tokens()
