"""RayDistributedExecutor: one worker actor per rank, across the machines of a Ray cluster.

The engine core is the Ray driver. It joins a cluster (lm_console/engine/executor/ray_utils.py), reserves
a placement group with one bundle per tensor-parallel rank, and starts one RayWorkerWrapper
actor in each bundle; each actor builds the same Worker class as the other executors, with its
rank, its local rank on its node and the torch.distributed rendezvous (tcp on 127.0.0.1 when
every rank shares one node, else rank 0's node address). collective_rpc sends the method to
every actor and returns the results in rank order; sample_tokens returns rank 0's.

A worker actor that dies (its process killed, its node lost) fails the step in progress with
EngineDeadError, and a monitor thread (one never-returning call per actor) reports it at once
through the failure callback even when the engine is idle; either way the engine core ends
and every caller gets EngineDeadError. The actors are owned by
the engine core: Ray stops them when the core exits, however it exits.

Non-blocking calls (async scheduling) share one daemon waiter thread, started on the first
such call: it takes (refs, pick, future) entries from a queue in submission order and resolves
each future from ray.get of its refs. A future still pending when the executor shuts down gets
EngineDeadError, never a hang.
"""

from __future__ import annotations

import math
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import msgspec

from lm_console.engine import envs
from lm_console.engine.errors import EngineDeadError, EngineUnresponsiveError
from lm_console.engine.executor.abstract import Executor
from lm_console.engine.executor.ray_utils import (
    RAY_NAMESPACE, RayWorkerWrapper, WorkerNodeInfo, connect, import_ray, make_placement_group, worker_bundle,
)
from lm_console.engine.executor.ray_utils import first_line as _first_line

if TYPE_CHECKING:
    from lm_console.engine.model_runner_output import ModelRunnerOutput
    from lm_console.engine.scheduler_output import SchedulerOutput

_START_TIMEOUT_S = envs.LMC_RAY_WORKER_START_TIMEOUT.as_float()
# A non-blocking call waiting for the waiter thread: the ranks' refs, what to keep of their
# results, the future to resolve.
_StepEntry = tuple[list[Any], Callable[[list[Any]], Any], Future[Any]]


class RayDistributedExecutor(Executor):
    """collective_rpc over one Ray actor per tensor-parallel rank."""

    def _init_executor(self) -> None:
        ray = import_ray()
        from ray.util.placement_group import remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        parallel, device = self.config.parallel_config, self.config.device_config.device
        self.world_size = parallel.tensor_parallel_size
        self.workers: list[Any] = []
        self.shutting_down = False
        self.failure_callback: Callable[[str], None] | None = None
        self.placement_group: Any = None
        # The non-blocking calls' waiter (see _future); the lock orders the shutdown marker after
        # every entry, so no entry is queued where the waiter will never look.
        self._waiter_lock = threading.Lock()
        self._waiter: threading.Thread | None = None
        self._steps: queue.SimpleQueue[_StepEntry | None] = queue.SimpleQueue()
        self.started_ray = connect()
        try:
            bundle = worker_bundle(device, parallel.ray_per_worker_cpus)
            heads = (self.config.model_config.num_attention_heads, self.config.model_config.num_kv_heads)
            self.placement_group = make_placement_group(
                self.world_size, bundle,
                remedy=lambda fit, nodes: _worker_remedy(self.world_size, device, heads, fit, nodes))
            # The worker's calls run one at a time in submission order; the monitor's
            # never-returning call has a thread of its own.
            actor_class = ray.remote(concurrency_groups={"monitor": 1})(RayWorkerWrapper)
            for rank in range(self.world_size):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=rank)
                self.workers.append(actor_class.options(
                    num_cpus=bundle.get("CPU", 0.0), num_gpus=bundle.get("GPU", 0.0),
                    scheduling_strategy=strategy, namespace=RAY_NAMESPACE,
                    name=f"lmc-worker-{os.getpid()}-dp{parallel.data_parallel_rank}-tp{rank}").remote())
            infos = [msgspec.msgpack.decode(raw, type=WorkerNodeInfo)
                     for raw in ray.get([w.node_info.remote() for w in self.workers], timeout=_START_TIMEOUT_S)]
            self.worker_pids = [info.pid for info in infos]
            init_method = None
            if self.world_size > 1:
                one_node = len({info.node_id for info in infos}) == 1
                host = "127.0.0.1" if one_node else infos[0].ip
                port = ray.get(self.workers[0].free_port.remote(), timeout=_START_TIMEOUT_S)
                init_method = f"tcp://{host}:{port}"
            local_ranks, node_gpus = _local_ranks(infos)
            ray.get([worker.init_worker.remote(
                self.config, rank, local_ranks[rank], init_method,
                node_gpus[infos[rank].node_id] if device == "cuda" else None)
                for rank, worker in enumerate(self.workers)], timeout=_START_TIMEOUT_S)
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
            self._watch_refs = [worker.wait_forever.options(concurrency_group="monitor").remote()
                                for worker in self.workers]
            threading.Thread(target=self._monitor, name="RayWorkerMonitor", daemon=True).start()
        except BaseException:
            self._release(ray, remove_placement_group)
            raise

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run `method` on every worker actor; results in rank order (Ray serializes the arguments)."""
        return self._results(method, self._submit(method, args, kwargs), timeout)

    def _submit(self, method: str | Callable[..., Any], args: tuple[Any, ...] = (),
                kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [worker.execute_method.remote(method, *args, **(kwargs or {})) for worker in self.workers]

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> Future[None] | None:
        """The step's forward pass on every rank; non_block: a Future done when every rank is."""
        refs = self._submit("execute_model", (scheduler_output,))
        if not non_block:
            self._results("execute_model", refs, None)
            return None
        return self._future(refs, lambda results: None)

    def sample_tokens(self, non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Rank 0's ModelRunnerOutput; non_block: a Future of it (Ray runs each actor's calls in order)."""
        refs = self._submit("sample_tokens")
        if not non_block:
            return self._results("sample_tokens", refs, None)[0]
        return self._future(refs, lambda results: results[0])

    def _future(self, refs: list[Any], pick: Callable[[list[Any]], Any]) -> Future[Any]:
        """A concurrent Future of pick(results), errors translated as in collective_rpc; the
        waiter thread resolves the futures in submission order."""
        future: Future[Any] = Future()
        with self._waiter_lock:
            if self.shutting_down:
                future.set_exception(_shut_down_error())
                return future
            if self._waiter is None:
                self._waiter = threading.Thread(target=self._wait_steps, args=(self._steps,),
                                                name="RayStepWaiter", daemon=True)
                self._waiter.start()
            self._steps.put((refs, pick, future))
        return future

    def _wait_steps(self, steps: queue.SimpleQueue[_StepEntry | None]) -> None:
        """The waiter thread: resolve each queued future until the shutdown marker (None)."""
        while (entry := steps.get()) is not None:
            refs, pick, future = entry
            if not future.set_running_or_notify_cancel():
                continue  # cancelled by its caller: nobody waits on it
            if self.shutting_down:
                future.set_exception(_shut_down_error())
                continue
            try:
                result = pick(self._results("a step", refs, None))
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
                # The actors are killed at shutdown: their refs fail, the cause is the shutdown.
                future.set_exception(_shut_down_error() if self.shutting_down else error)
            else:
                future.set_result(result)

    def _results(self, method: str | Callable[..., Any], refs: list[Any], timeout: float | None) -> list[Any]:
        ray = import_ray()
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.RayActorError as error:
            raise EngineDeadError(f"A Ray worker actor died during {_name(method)}: {_first_line(error)}") from None
        except ray.exceptions.RayTaskError as error:
            # A rank's collective fails when its peer dies: name the dead actor, the cause.
            dead = self._dead_rank(wait_s=1.0)
            if dead is not None:
                raise EngineDeadError(
                    f"The Ray worker actor of rank {dead} died during {_name(method)} (the other ranks' "
                    f"collectives failed with it: {_first_line(error)})") from None
            raise
        except ray.exceptions.GetTimeoutError:
            raise EngineUnresponsiveError(
                f"The Ray worker actors did not answer {_name(method)} within {timeout} s.") from None

    def _dead_rank(self, wait_s: float) -> int | None:
        """The rank of a worker actor that is gone (its watch call ended), waiting up to wait_s."""
        refs = getattr(self, "_watch_refs", None)
        if not refs:
            return None
        done, _ = import_ray().wait(refs, num_returns=1, timeout=wait_s)
        return refs.index(done[0]) if done else None

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        """Have callback(reason) called when a worker actor dies, busy or idle (the monitor thread)."""
        self.failure_callback = callback

    def _monitor(self) -> None:
        ray = import_ray()
        refs = self._watch_refs
        done, _ = ray.wait(refs, num_returns=1)  # returns only when an actor is gone
        rank = refs.index(done[0])
        try:
            ray.get(done)
            reason = f"The Ray worker actor of rank {rank} ended."
        except Exception as error:  # noqa: BLE001 - RayActorError: the actor died (or Ray went away)
            reason = f"The Ray worker actor of rank {rank} died: {type(error).__name__}: {_first_line(error)}"
        if not self.shutting_down and self.failure_callback is not None:
            self.failure_callback(reason)

    def check_health(self) -> None:
        """Raise EngineDeadError if a worker actor is gone."""
        self.collective_rpc(lambda worker: None, timeout=10.0)

    def shutdown(self) -> None:
        """Kill the worker actors, free the placement group, stop a Ray instance this executor started."""
        if not hasattr(self, "workers"):
            return
        ray = import_ray()
        from ray.util.placement_group import remove_placement_group

        self._release(ray, remove_placement_group)

    def _release(self, ray: Any, remove_placement_group: Callable[[Any], None]) -> None:
        with self._waiter_lock:
            self.shutting_down = True  # the monitor sees the actors go: no failure
            waiter, self._waiter = self._waiter, None
            if waiter is not None:
                self._steps.put(None)  # after every entry: the waiter answers them all, then ends
        workers, self.workers = self.workers, []
        for worker in workers:
            try:
                ray.kill(worker)
            except Exception:  # noqa: BLE001 - already gone
                pass
        group, self.placement_group = self.placement_group, None
        if group is not None:
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001 - the cluster is going away
                pass
        if waiter is not None and waiter is not threading.current_thread():
            # Its ray.get returns once the actors are gone; bounded, as it is a daemon anyway.
            waiter.join(timeout=10.0)
        if self.started_ray and ray.is_initialized():
            self.started_ray = False
            ray.shutdown()


def _worker_remedy(world_size: int, device: str, heads: tuple[int, int], fit: int,
                   nodes: list[dict[str, float]]) -> str:
    """What to change when the cluster can never hold world_size worker bundles: fewer ranks (a
    size the model's query and KV heads divide by), or on the CPU a smaller CPU request per
    worker that fits them all on the largest node."""
    sizes = [size for size in range(fit, 0, -1) if all(count % size == 0 for count in heads)]
    fewer = f"tensor_parallel_size={sizes[0]}" if sizes else "a cluster with room for one worker"
    if sizes and sizes[0] > 1:
        fewer += " (or fewer that the model's heads divide by)"
    if device == "cuda":
        return f"use {fewer} (one GPU per rank)"
    largest = max((node.get("CPU", 0.0) for node in nodes), default=0.0)
    share = math.floor(100 * largest / world_size) / 100
    if share <= 0:
        return f"use {fewer}"
    return (f"use {fewer}, or let the {world_size} workers share the CPUs with the engine argument "
            f"ray_per_worker_cpus={share} (CPUs each worker reserves; default 1)")


def _shut_down_error() -> EngineDeadError:
    return EngineDeadError("The Ray executor was shut down before this step's result came back.")


def _local_ranks(infos: list[WorkerNodeInfo]) -> tuple[list[int], dict[str, str]]:
    """Each rank's index among the ranks on its node, and each node's GPUs (for CUDA_VISIBLE_DEVICES)."""
    counts: dict[str, int] = {}
    gpus: dict[str, list[str]] = {}
    local_ranks = []
    for info in infos:
        local_ranks.append(counts.get(info.node_id, 0))
        counts[info.node_id] = local_ranks[-1] + 1
        gpus.setdefault(info.node_id, []).extend(info.gpu_ids)
    return local_ranks, {node: ",".join(ids) for node, ids in gpus.items()}


def _name(method: str | Callable[..., Any]) -> str:
    return method if isinstance(method, str) else getattr(method, "__name__", "a function")
