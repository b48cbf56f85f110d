"""ParallelConfig: tensor and data parallelism, and the executor backend."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lm_console.engine.config.fields import DeclaredConfig, knob

ExecutorBackend = Literal["uni", "fake", "mp", "ray"]
DataParallelBackend = Literal["mp", "ray"]
DataParallelRouting = Literal["least_loaded", "prefix"]


@dataclass(frozen=True)
class ParallelConfig(DeclaredConfig):
    """How the model is spread over workers and engine cores."""

    tensor_parallel_size: int = knob(1, ge=1, help="Workers per engine core, each holding a slice of the model.")
    # lm_console/engine/frontend/dp_client.py runs the cores.
    data_parallel_size: int = knob(
        1, ge=1, le=64, help="Engine cores behind one frontend, each with the whole model and its own KV cache "
                             "(the console: c cycles).")
    # Executor.get_class; "fake" runs no model (FakeExecutor); tp > 1 with uni switches to mp
    # (one process cannot hold several ranks, as vLLM switches).
    distributed_executor_backend: ExecutorBackend = knob(
        "uni", help="Where a core's workers run: uni (in the core) | mp (a process per tensor-parallel rank) | "
                    "ray (Ray actors, across a Ray cluster) | fake (no model).")
    data_parallel_rank: int = knob(
        0, ge=0, cli=None, help="This engine core's index among data_parallel_size (the DP client sets it; "
                                "leave it at 0).")
    data_parallel_backend: DataParallelBackend = knob(
        "mp", help="Where the --data-parallel-size engine cores run: mp (processes here) | ray (Ray actors, "
                   "across a Ray cluster).")
    data_parallel_routing: DataParallelRouting = knob(
        "least_loaded", help="least_loaded | prefix (prefer the core holding the request's longest cached prefix).")
    # A fraction lets more ranks than the cluster has CPUs share them, e.g. tensor_parallel_size=3
    # with 0.5 on a 2-CPU machine (the ranks' threads then share the cores).
    ray_per_worker_cpus: float | None = knob(
        None, gt=0.0, cli=None, help="CPUs each Ray worker actor reserves (distributed_executor_backend='ray'; "
                                     "None: 1 on the CPU, none on CUDA).")

    @classmethod
    def verify_relations(cls, values: Mapping[str, Any]) -> None:
        """The rank within the size; Ray CPUs only with the Ray backend."""
        from lm_console.engine.errors import InvalidEngineArgsError

        size, rank = values.get("data_parallel_size", 1), values.get("data_parallel_rank", 0)
        if not rank < size:
            raise InvalidEngineArgsError(
                f"data_parallel_rank={rank!r} is invalid: it must be in [0, data_parallel_size={size}) "
                "(the DP client sets it for each core; leave it at 0).")
        backend = values.get("distributed_executor_backend", "uni")
        if values.get("ray_per_worker_cpus") is not None and backend != "ray":
            raise InvalidEngineArgsError(
                f"ray_per_worker_cpus={values['ray_per_worker_cpus']!r} sizes Ray worker actors; it needs "
                f"distributed_executor_backend='ray' (got {backend!r}).")
