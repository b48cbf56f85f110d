"""Executor: the engine core's one handle on the workers (after vLLM's vllm/v1/executor/abstract.py).

EngineCore.step() calls execute_model() then sample_tokens(); each is a collective_rpc() that
runs the same Worker method on every worker and returns the output rank's result (rank 0).
With async scheduling, EngineCore.step_with_batch_queue() calls both with non_block=True (each
returns a Future at once) and keeps max_concurrent_batches batches in flight.
The KV cache is sized and allocated through the executor too, so the core never touches a
worker. Implementations: UniProcExecutor (the worker in this process, the default) and
FakeExecutor (no torch, no model: the console's demo engine and tests); a multiprocess and a
Ray executor (one worker per tensor-parallel rank) fit the same interface.

This module imports no torch and no worker, so `engine.core.engine_core` stays torch-free until
get_class() imports the executor the config names.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.engine.startup_trace import mark

if TYPE_CHECKING:
    from lm_console.engine.config.engine_config import EngineConfig
    from lm_console.engine.kv_cache_interface import KVCacheSpec
    from lm_console.engine.model_runner_output import ModelRunnerOutput
    from lm_console.engine.scheduler_output import SchedulerOutput

# distributed_executor_backend -> "module:Class", imported on first use.
EXECUTOR_BACKENDS: dict[str, str] = {
    "uni": "lm_console.engine.executor.uniproc:UniProcExecutor",
    "fake": "lm_console.engine.executor.fake:FakeExecutor",
    "mp": "lm_console.engine.executor.multiproc:MultiprocExecutor",
    "ray": "lm_console.engine.executor.ray_executor:RayDistributedExecutor",
}


class Executor(ABC):
    """Runs one step of the model on its workers and reports what they computed.

    Invariant: every worker holds the same model and the same KV cache layout, so
    get_kv_cache_spec() and sample_tokens() return the output rank's answer for all of them.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._deferred: Any = None  # DeferredCalls, made on the first non-blocking call
        self._init_executor()

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        """The executor class that config.parallel_config.distributed_executor_backend names."""
        backend = config.parallel_config.distributed_executor_backend
        target = EXECUTOR_BACKENDS.get(backend)
        if target is None:
            raise InvalidEngineArgsError(
                f"distributed_executor_backend={backend!r} is not supported; allowed: {sorted(EXECUTOR_BACKENDS)}.")
        module_name, class_name = target.split(":")
        executor_class = getattr(importlib.import_module(module_name), class_name)
        assert issubclass(executor_class, Executor), executor_class
        return executor_class

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers: init_device and load_model on each."""

    @abstractmethod
    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run `method` (a Worker method name, or a function called with the worker first) on
        every worker and return their results in rank order."""

    # -- KV cache memory ------------------------------------------------
    def determine_num_available_blocks(self) -> int:
        """KV cache blocks that fit the memory budget on every worker (the smallest answer)."""
        return min(self.collective_rpc("determine_num_available_blocks"))

    def get_kv_cache_block_bytes(self) -> int:
        """Bytes one KV cache block takes on a worker (to say how much memory a shortfall needs)."""
        return max(self.collective_rpc("get_kv_cache_block_bytes"))

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """Each attention layer's KVCacheSpec (the same on every worker)."""
        return self.collective_rpc("get_kv_cache_spec")[0]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate num_blocks KV cache blocks on every worker."""
        self.collective_rpc("initialize_kv_cache", args=(num_blocks,))
        mark("kv_cache")

    # -- the step ------------------------------------------------------------------------------
    @property
    def max_concurrent_batches(self) -> int:
        """Batches EngineCore keeps in flight: 2 with async scheduling (step N+1 is scheduled
        while step N runs), else 1 (the plain step())."""
        return 2 if self.config.scheduler_config.async_scheduling else 1

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> None | Future[None]:
        """Run the forward pass of this step on every worker; the logits stay there.

        non_block=True returns a Future at once. This default defers the call until the Future
        (or a later call's) is awaited, keeping the calls in order; executors with workers
        elsewhere (a thread, processes) override it to run the step while the caller goes on.
        """
        if non_block:
            return self._submit_deferred(self.execute_model, scheduler_output)
        self._run_deferred()
        self.collective_rpc("execute_model", args=(scheduler_output,))
        return None

    def sample_tokens(self, non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Sample from the stored logits; the output rank's ModelRunnerOutput (a Future of it
        with non_block=True, as for execute_model)."""
        if non_block:
            return self._submit_deferred(self.sample_tokens)
        self._run_deferred()
        return self.collective_rpc("sample_tokens")[0]

    def _submit_deferred(self, method: Callable[..., Any], *args: Any) -> Future[Any]:
        from lm_console.engine.executor.deferred import DeferredCalls

        if self._deferred is None:
            self._deferred = DeferredCalls()
        return self._deferred.submit(method, *args)

    def _run_deferred(self) -> None:
        """Run the deferred calls submitted before a blocking one (order is kept)."""
        if self._deferred is not None and self._deferred.num_pending:
            self._deferred.run_until(None)

    # -- lifecycle -----------------------------------------------------------------------------
    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        """Have callback(reason) called if a worker dies; in-process workers cannot die alone."""

    def check_health(self) -> None:
        """Raise if a worker is dead or unresponsive; in-process workers are alive while we are."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release their resources (idempotent)."""
