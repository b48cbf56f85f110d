"""data_parallel_backend="ray": the engine cores as Ray actors, placed by one placement group.

Ray only starts and places the cores. Each core is a RayEngineCoreActor in its own bundle of a
placement group (PACK: one node first, then the next): {"CPU": tp} on CPU or {"GPU": tp} on
CUDA when the core's own workers run in it (executor uni or mp), {"CPU": 1} when they are Ray
actors of their own (executor ray: the core reserves their bundles itself, as a single core
does). The actor runs the same engine-core busy loop as a core process of the mp backend
(run_engine_core, in the actor's main thread), and it talks to the frontend over the same ZMQ
sockets and msgspec messages, never through Ray: the frontend binds them, private ipc paths
(0700 directory) or loopback tcp when every core is on this machine, tcp on this node's
address with CURVE when one is not (the keys reach the core as its actor-call arguments,
inside the Ray cluster). The DP client (lm_console/engine/frontend/dp_client.py) routes, merges and
fails exactly as with the mp backend.

A core's death: the frontend holds the actor's never-ending `run` call; a monitor thread per
core waits on it and, when it fails (the actor's process killed, its node lost), wakes the
core's reader thread through a pipe that stands in for a process sentinel, so every caller
gets EngineDeadError at once. Orphans: the actors are owned by the frontend's Ray driver, so
Ray ends them when the frontend exits, however it exits; shutdown kills them and removes the
placement group (and stops the Ray instance the frontend started, if it started one). Ray ends
those actors with SIGKILL, so a core on the frontend's node also watches the frontend's process
and removes its socket directory when it is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import threading
import time
from typing import Any

import msgspec

from lm_console.engine import envs
from lm_console.engine.config.engine_args import EngineArgs
from lm_console.engine.errors import EngineStartupError
from lm_console.engine.executor.ray_utils import (
    RAY_NAMESPACE, WorkerNodeInfo, connect, first_line, import_ray, make_placement_group, node_info,
)
from lm_console.engine.frontend.engine_process import EngineProcess
from lm_console.engine.ipc import EngineAddresses, make_engine_addresses

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = envs.LMC_RAY_CORE_START_TIMEOUT.as_float()
_OPTION = "data_parallel_backend"


class RayEngineCoreActor:
    """The body of one engine-core actor: where it runs, then the core's busy loop until SHUTDOWN."""

    def node_info(self) -> bytes:
        return node_info()

    def run(self, engine_args: EngineArgs, addresses: EngineAddresses, identity: bytes,
            frontend_pid: int | None = None) -> None:
        """The engine core, as in a core process; returns when the core shuts down.

        frontend_pid: the frontend's process on this node, whose private socket directory this
        core removes as soon as that process is gone.
        """
        # The actor's owner (the frontend's driver) ending ends the actor: no death pipe needed.
        # But Ray ends it with SIGKILL, so the core's own clean-up would not run: a frontend
        # killed with SIGKILL would leave its socket directory behind without this watcher.
        if frontend_pid is not None and addresses.ipc_dir is not None:
            threading.Thread(target=_remove_when_gone, args=(frontend_pid, addresses.ipc_dir),
                             name="FrontendWatch", daemon=True).start()
        from lm_console.engine.core.engine_core_proc import run_engine_core

        run_engine_core(engine_args, addresses, identity, None)


def _remove_when_gone(pid: int, path: str) -> None:
    """Remove path once process pid has exited (pidfd where Linux has it, else polling)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        select.select([fd], [], [])
        os.close(fd)
    else:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:
                pass
            time.sleep(0.2)
    shutil.rmtree(path, ignore_errors=True)


def core_bundle(engine_args: EngineArgs, cluster_resources: dict[str, float]) -> dict[str, float]:
    """One core's placement-group bundle (see the module docstring); device auto: CUDA when the
    cluster has GPUs."""
    if engine_args.distributed_executor_backend == "ray":
        return {"CPU": 1.0}  # the core drives; its worker actors reserve their own bundles
    tp = float(engine_args.tensor_parallel_size)
    device = engine_args.device
    if device == "auto":
        device = "cuda" if cluster_resources.get("GPU", 0) > 0 else "cpu"
    return {"GPU": tp} if device == "cuda" else {"CPU": tp}


def frontend_host(core_nodes: list[str], this_node: str, this_ip: str) -> str | None:
    """Where the frontend binds its sockets: None (the configured ipc or loopback transport) when
    every core runs on this node, else this node's address (tcp, CURVE)."""
    return None if all(node == this_node for node in core_nodes) else this_ip


class _RayCoreHandle:
    """A core actor seen as a process: what EngineProcess and the reader thread use of one.

    sentinel is a pipe that becomes readable when the actor's `run` call ends, normally
    (the core shut down) or not (the actor died).
    """

    def __init__(self, ray: Any, actor: Any, run_ref: Any, pid: int) -> None:
        self.ray = ray
        self.actor = actor
        self.run_ref = run_ref
        self.pid = pid
        self.exitcode: int | None = None
        self.reason = ""
        self.sentinel, self._wake = os.pipe()
        self._ended = threading.Event()
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="RayCoreMonitor", daemon=True)
        self._monitor.start()

    def _watch(self) -> None:
        ray = self.ray
        try:
            while not self._stop.is_set():
                done, _ = ray.wait([self.run_ref], timeout=1.0)
                if done:
                    break
            else:
                return
            ray.get(self.run_ref)
            self.exitcode, self.reason = 0, "its engine core shut down"
        except Exception as error:  # noqa: BLE001 - ActorDiedError, or Ray itself went away
            self.exitcode, self.reason = 1, f"{type(error).__name__}: {first_line(error)}"
        finally:
            self._ended.set()
            with contextlib.suppress(OSError):
                os.write(self._wake, b"x")

    def is_alive(self) -> bool:
        return not self._ended.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._ended.wait(timeout)

    def kill(self) -> None:
        with contextlib.suppress(Exception):  # already gone, or Ray is shutting down
            self.ray.kill(self.actor, no_restart=True)

    terminate = kill

    def release(self) -> None:
        """Kill the actor (it outlives a core that shut down) and stop watching it."""
        self.kill()
        self._stop.set()
        self._monitor.join(5.0)
        for fd in (self.sentinel, self._wake):
            with contextlib.suppress(OSError):
                os.close(fd)


class RayEngineProcess(EngineProcess):
    """EngineProcess whose core is a Ray actor already placed (RayCores makes them)."""

    def __init__(self, engine_args: EngineArgs, actor: Any, node: WorkerNodeInfo, host: str | None,
                 name: str) -> None:
        self.actor, self.node, self.host, self.name = actor, node, host, name
        super().__init__(engine_args)

    def _make_addresses(self, num_clients: int) -> EngineAddresses:
        if self.host is None:  # this machine: ipc (0700) or loopback tcp, as configured
            return super()._make_addresses(num_clients)
        return make_engine_addresses("tcp", num_clients, self.engine_args.enable_kv_cache_events,
                                     host=self.host, kv_events_host=self.node.ip)

    def launch(self) -> None:
        """Start the core's busy loop in its actor (Ray serializes the arguments; the engine's
        own messages then go over the sockets bound above)."""
        ray = import_ray(_OPTION)
        frontend_pid = os.getpid() if self.host is None else None  # same node: same pids
        run_ref = self.actor.run.remote(self.engine_args, self.addresses, self.core_identity, frontend_pid)
        self.proc = _RayCoreHandle(ray, self.actor, run_ref, self.node.pid)

    def exit_description(self) -> str:
        return (f"The engine core's Ray actor {self.name} (pid {self.node.pid} on {self.node.ip}) died: "
                f"{self.proc.reason or 'it ended'}.")

    def close(self, sink: Any = None) -> None:
        super().close(sink)
        if self.proc is not None:
            self.proc.release()


class RayCores:
    """The cores' placement group and actors (one RayEngineProcess each), launched; close() after
    the cores have closed."""

    def __init__(self, engine_args: EngineArgs, core_args: list[EngineArgs]) -> None:
        ray = import_ray(_OPTION)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray = ray
        self.started_ray = connect(_OPTION)
        self.placement_group: Any = None
        self.actors: list[Any] = []
        self.processes: list[RayEngineProcess] = []
        self.closed = False
        try:
            num_cores = engine_args.data_parallel_size
            bundle = core_bundle(engine_args, ray.cluster_resources())
            self.placement_group = make_placement_group(
                num_cores, bundle, what="engine cores", remedy="lower data_parallel_size")
            actor_class = ray.remote(RayEngineCoreActor)
            names = [f"lmc-core-{os.getpid()}-dp{rank}" for rank in range(num_cores)]
            for rank in range(num_cores):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=rank)
                self.actors.append(actor_class.options(
                    num_cpus=bundle.get("CPU", 0.0), num_gpus=bundle.get("GPU", 0.0), max_restarts=0,
                    scheduling_strategy=strategy, namespace=RAY_NAMESPACE, name=names[rank]).remote())
            try:
                nodes = [msgspec.msgpack.decode(raw, type=WorkerNodeInfo) for raw in
                         ray.get([actor.node_info.remote() for actor in self.actors], timeout=_START_TIMEOUT_S)]
            except ray.exceptions.GetTimeoutError:
                raise EngineStartupError(
                    f"The Ray engine-core actors did not start within {_START_TIMEOUT_S:.0f} s.") from None
            context = ray.get_runtime_context()
            host = frontend_host([node.node_id for node in nodes], context.get_node_id(),
                                 ray.util.get_node_ip_address())
            for rank, actor in enumerate(self.actors):
                self.processes.append(RayEngineProcess(core_args[rank], actor, nodes[rank], host, names[rank]))
                self.processes[-1].launch()
        except BaseException:
            for process in self.processes:
                process.close()
            self.close()
            raise

    def close(self) -> None:
        """Kill every core actor, remove the placement group, stop a Ray instance started here
        (idempotent; the cores' EngineProcess.close has already asked each to shut down)."""
        if self.closed:
            return
        self.closed = True
        ray = self.ray
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.placement_group)
        if self.started_ray and ray.is_initialized():
            ray.shutdown()


__all__ = ["RayCores", "RayEngineCoreActor", "RayEngineProcess", "core_bundle", "frontend_host"]
