"""UniProcExecutor: the worker lives in the engine-core process."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from lm_console.engine.executor.abstract import Executor
from lm_console.engine.executor.deferred import WorkerThread
from lm_console.engine.startup_trace import mark
from lm_console.engine.worker.worker import Worker

if TYPE_CHECKING:
    from lm_console.engine.model_runner_output import ModelRunnerOutput
    from lm_console.engine.scheduler_output import SchedulerOutput


class UniProcExecutor(Executor):
    """collective_rpc over a single in-process Worker (rank 0, the output rank).

    With async scheduling the worker runs on its own thread (`worker_thread`), so a step's
    forward pass runs while the engine core schedules the next step and processes the previous
    one's output. Every call then goes through that thread: the worker is never entered by two
    threads at once, and calls run in the order they were made.
    """

    def _init_executor(self) -> None:
        # In-process debugging and tests reach the model runner through self.worker; the
        # engine core never does.
        self.worker: Worker = Worker(self.config)
        self.worker_thread: WorkerThread | None = (
            WorkerThread() if self.config.scheduler_config.async_scheduling else None)
        self.collective_rpc("init_device")
        mark("device")
        self.collective_rpc("load_model")
        mark("weights")

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call `method` on the one worker (on its thread, if it has one); timeout is moot in-process."""
        kwargs = kwargs or {}
        call = getattr(self.worker, method) if isinstance(method, str) else (
            lambda *a, **k: method(self.worker, *a, **k))
        if self.worker_thread is not None:
            return [self.worker_thread.call(call, *args, **kwargs)]
        return [call(*args, **kwargs)]

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> None | Future[None]:
        """The forward pass; with non_block=True it runs on the worker thread and a Future returns at once."""
        if non_block and self.worker_thread is not None:
            return self.worker_thread.submit(self.worker.execute_model, scheduler_output)
        return super().execute_model(scheduler_output, non_block)

    def sample_tokens(self, non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if non_block and self.worker_thread is not None:
            return self.worker_thread.submit(self.worker.sample_tokens)
        return super().sample_tokens(non_block)

    def shutdown(self) -> None:
        if self.worker_thread is not None:
            self.worker_thread.shutdown()
        self.worker.shutdown()
        self.worker.model_runner = None
