"""ParallelConfig: tensor and data parallelism, and the executor backend."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over workers and engine cores (one of each for now)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "uni"  # Executor.get_class: uni | fake | mp | ray
    data_parallel_rank: int = 0  # this engine core's index among data_parallel_size
    data_parallel_backend: str = "mp"  # mp | ray
    # CPUs each Ray worker actor reserves in its placement bundle (distributed_executor_backend="ray");
    # None: 1 on the CPU, none on CUDA (the bundle is the worker's GPU).
    ray_per_worker_cpus: float | None = None
