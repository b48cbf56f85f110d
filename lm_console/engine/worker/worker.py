"""Worker: one device, one ModelRunner (after vLLM's vllm/v1/worker/gpu_worker.py)."""

from __future__ import annotations


import torch

from lm_console.engine.config.engine_config import EngineConfig
from lm_console.engine.distributed.parallel_state import destroy_distributed, init_distributed
from lm_console.engine.kv_cache_interface import KVCacheSpec
from lm_console.engine.malloc_tuning import tune_malloc
from lm_console.engine.model_runner_output import ModelRunnerOutput
from lm_console.engine.platform import usable_cpus
from lm_console.engine.scheduler_output import SchedulerOutput
from lm_console.engine.worker.model_runner import ModelRunner

_DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# Decode graphs' own activations and allocator slack, kept out of the KV budget on CUDA.
_CUDA_GRAPH_RESERVE_BYTES = 512 << 20


class Worker:
    """Sets up the device, loads the model, sizes and allocates the KV cache, runs steps."""

    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: str | None = None, is_driver_worker: bool = True) -> None:
        """rank: this worker's tensor-parallel rank (0 is the output rank); local_rank: its device
        index on this machine; distributed_init_method: torch.distributed's rendezvous address
        (None: a single worker, no process group)."""
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        device = self.config.device_config
        tp_size = self.config.parallel_config.tensor_parallel_size
        if device.device == "cpu":
            # The ranks share the CPUs this process may use (affinity and cgroup quota, not the
            # machine's count): each takes its share unless num_threads says otherwise.
            torch.set_num_threads(device.num_threads or max(1, usable_cpus() // tp_size))
            tune_malloc()  # a step's activations reuse the last step's memory (lm_console/engine/malloc_tuning.py)
        init_distributed(tp_size, self.rank, self.distributed_init_method,
                         "nccl" if device.device == "cuda" else "gloo", self.local_rank)
        torch.manual_seed(self.config.model_config.seed)
        kv_connector = None
        if self.config.kv_transfer_config is not None:
            from lm_console.engine.distributed.kv_transfer.base import KVConnectorRole
            from lm_console.engine.distributed.kv_transfer.factory import KVConnectorFactory

            kv_connector = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER)
        self.model_runner = ModelRunner(self.config, kv_connector)

    def load_model(self) -> None:
        assert self.model_runner is not None
        self.model_runner.load_model()

    def determine_num_available_blocks(self) -> int:
        """Blocks that fit the KV budget: kv_cache_memory on CPU, profiled free memory on CUDA."""
        assert self.model_runner is not None
        block_bytes = self.model_runner.get_kv_cache_block_bytes()
        if self.config.device_config.device == "cuda":
            return max(self._profile_cuda_kv_budget() // block_bytes, 0)
        budget = self.config.cache_config.kv_cache_memory or _DEFAULT_CPU_KV_CACHE_BYTES
        return budget // block_bytes

    def _profile_cuda_kv_budget(self) -> int:
        """Bytes left for the KV cache: total * gpu_memory_utilization, minus what the device
        holds now (weights, CUDA context, other processes), minus the activation peak of a
        max_num_batched_tokens dummy forward, minus a reserve for CUDA graphs."""
        assert self.model_runner is not None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        self.model_runner.profile_run()
        torch.cuda.synchronize()
        activation_peak = torch.cuda.max_memory_allocated() - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        budget = int(total * self.config.cache_config.gpu_memory_utilization) - (total - free)
        return budget - activation_peak - _CUDA_GRAPH_RESERVE_BYTES

    def get_kv_cache_block_bytes(self) -> int:
        assert self.model_runner is not None
        return self.model_runner.get_kv_cache_block_bytes()

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        assert self.model_runner is not None
        return self.model_runner.get_kv_cache_spec()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        assert self.model_runner is not None
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        assert self.model_runner is not None
        self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self) -> ModelRunnerOutput:
        assert self.model_runner is not None
        return self.model_runner.sample_tokens()

    def shutdown(self) -> None:
        """Stop the worker-side KV connector's threads (idempotent)."""
        if self.model_runner is not None:
            self.model_runner.kv_transfer.shutdown()
        if self.config.parallel_config.tensor_parallel_size > 1:
            destroy_distributed()
