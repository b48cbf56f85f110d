"""UniProcExecutor: the worker lives in the engine-core process (seed: Executor, 1393-1558)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.executor.abstract import Executor
from engine.worker.worker import Worker


class UniProcExecutor(Executor):
    """collective_rpc over a single in-process Worker (rank 0, the output rank)."""

    def _init_executor(self) -> None:
        # In-process debugging and tests reach the model runner through self.worker; the
        # engine core never does.
        self.worker: Worker = Worker(self.config)
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call `method` on the one worker; timeout is moot in-process (the call is synchronous)."""
        kwargs = kwargs or {}
        if isinstance(method, str):
            return [getattr(self.worker, method)(*args, **kwargs)]
        return [method(self.worker, *args, **kwargs)]

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.worker.model_runner = None
