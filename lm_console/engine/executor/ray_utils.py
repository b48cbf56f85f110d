"""Ray plumbing for RayDistributedExecutor: the cluster connection, the placement group, the worker actor.

Which cluster: the one this process already joined (ray.is_initialized()), else RAY_ADDRESS
(the frontend hands its own to the engine core, see core_ray_environment), else one that
`ray start` runs on this machine, else a private local instance that the executor starts and stops.
Placement: one bundle per rank ({"CPU": 1} on CPU, {"GPU": 1} on CUDA), PACK strategy, so the
ranks fill one node before spilling to the next. Nothing here imports ray at module level:
the frontend calls core_ray_environment without Ray installed.

What crosses Ray: the worker methods' arguments and results, serialized by Ray itself (its
pickle-based object store, over Ray's own channels, not one of the engine's sockets); the
worker's node report, which is ours, is msgspec.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from lm_console.engine import envs
from lm_console.engine.errors import EngineStartupError, InvalidEngineArgsError

RAY_NAMESPACE = "lm-console"
PLACEMENT_TIMEOUT_S = envs.LMC_RAY_PLACEMENT_TIMEOUT.as_float()


def import_ray(option: str = "distributed_executor_backend") -> Any:
    """The ray module, or a clear error naming the option that asked for it and the extra to install."""
    try:
        import ray
    except ImportError:
        raise InvalidEngineArgsError(
            f"{option}='ray' needs Ray: pip install 'lm-console[ray]' (or pip install ray).") from None
    return ray


# Ray's own switch: "0" makes a single-machine instance use 127.0.0.1 instead of the machine's address.
_LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def core_ray_environment() -> dict[str, str]:
    """The Ray settings of the frontend that the engine core needs: the cluster it joined (else
    $RAY_ADDRESS) and Ray's loopback switch.

    The core starts from a forkserver that predates a later ray.init or os.environ change in
    the frontend, so they are handed on explicitly.
    """
    environment = {}
    ray = sys.modules.get("ray")
    address = ray.get_runtime_context().gcs_address if ray is not None and ray.is_initialized() else None
    address = address or envs.RAY_ADDRESS.get() or None
    if address:
        environment["RAY_ADDRESS"] = address
    # RAY_AUTH_MODE: ray.init sets it in the process that started the cluster (token auth, with
    # the token in ~/.ray); a core without it is refused by that cluster. RAY_AUTH_TOKEN(_PATH):
    # a token the user handed to the frontend.
    for name in (_LOOPBACK_SWITCH, "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        if name in os.environ:
            environment[name] = os.environ[name]
    return environment


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def first_line(error: BaseException) -> str:
    """A Ray error's first line without the terminal colour codes Ray puts in it (the message
    reaches the console, HTTP answers and logs, where they show as garbage)."""
    text = _ANSI_ESCAPE.sub("", str(error)).strip()
    return text.splitlines()[0] if text else repr(error)


def connect(option: str = "distributed_executor_backend") -> bool:
    """Join the cluster (see the module docstring); True when this call started a local instance."""
    ray = import_ray(option)
    if ray.is_initialized():
        return False
    address = envs.RAY_ADDRESS.get() or None
    if address:
        ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)
        return False
    try:  # a cluster that `ray start` runs on this machine
        ray.init(address="auto", namespace=RAY_NAMESPACE, log_to_driver=False)
        return False
    except ConnectionError:
        pass
    ray.init(namespace=RAY_NAMESPACE, include_dashboard=False, log_to_driver=False)
    return True


def worker_bundle(device: str, cpus: float | None = None) -> dict[str, float]:
    """One worker actor's bundle: its GPU on CUDA (plus `cpus` when given), `cpus` CPUs on the
    CPU (default 1: ray_per_worker_cpus)."""
    if device == "cuda":
        return {"GPU": 1.0, **({"CPU": float(cpus)} if cpus else {})}
    return {"CPU": 1.0 if cpus is None else float(cpus)}


# Ray counts resources in fixed-point units of 1/10000: so does the check, with Ray's answer.
_RESOURCE_UNITS = 10_000


def bundles_that_fit(bundle: dict[str, float], nodes: list[dict[str, float]]) -> int:
    """How many copies of bundle the nodes' total resources hold, each copy on one node (a bundle
    never spans nodes), however busy the nodes are now."""
    fits = 0
    for resources in nodes:
        per_node = [round(resources.get(name, 0.0) * _RESOURCE_UNITS) // round(amount * _RESOURCE_UNITS)
                    for name, amount in bundle.items() if round(amount * _RESOURCE_UNITS) > 0]
        fits += min(per_node) if per_node else 0
    return fits


def _node_totals(ray: Any) -> list[dict[str, float]]:
    """The total resources of each alive node of the cluster."""
    return [dict(node.get("Resources", {})) for node in ray.nodes() if node.get("Alive")]


def _summary(resources: dict[str, float], names: Any) -> dict[str, float]:
    """The resources a bundle asks for, out of a cluster's (Ray adds memory, node ids, ...)."""
    return {name: round(float(resources.get(name, 0.0)), 4) for name in names}


Remedy = Callable[[int, list[dict[str, float]]], str]


def make_placement_group(world_size: int, bundle: dict[str, float], what: str = "workers",
                         remedy: str | Remedy = "lower tensor_parallel_size") -> Any:
    """world_size copies of bundle (one per rank: worker_bundle for the workers), reserved before
    any actor starts.

    A cluster whose nodes could never hold them, even idle, is refused at once: Ray would keep
    the group pending forever. One that could but is busy now gets PLACEMENT_TIMEOUT_S for other
    jobs to free their share. remedy: what the user can change, or a function of (the bundles
    that fit, each node's total resources) that says it.
    """
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    nodes = _node_totals(ray)
    fit = bundles_that_fit(bundle, nodes)
    if fit < world_size:
        advice = remedy if isinstance(remedy, str) else remedy(fit, nodes)
        total = {name: sum(node.get(name, 0.0) for node in nodes) for name in bundle}
        raise EngineStartupError(
            f"The Ray cluster can never place {world_size} {what} with {bundle} each: its "
            f"{len(nodes)} node(s) have {_summary(total, bundle)} in all, room for {fit} such bundle(s) "
            f"(a bundle never spans nodes). To proceed: {advice}, or add nodes to the cluster (ray start "
            "--address ...).")
    group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise EngineStartupError(
            f"The Ray cluster cannot place {world_size} {what} with {bundle} each within "
            f"{PLACEMENT_TIMEOUT_S:.0f} s: it has {_summary(ray.cluster_resources(), bundle)} in all but "
            f"only {_summary(ray.available_resources(), bundle)} free: other jobs hold the rest. Wait for "
            f"them to end, add nodes (ray start --address ...), or start fewer {what}."
        ) from None
    return group


class WorkerNodeInfo(msgspec.Struct, array_like=True):
    """Where one worker actor runs (its report to the executor)."""

    node_id: str
    ip: str
    pid: int
    gpu_ids: list[str] = []


def node_info() -> bytes:
    """This actor's WorkerNodeInfo, msgpack-encoded."""
    import ray

    context = ray.get_runtime_context()
    gpu_ids = [str(i) for i in ray.get_gpu_ids()]
    return msgspec.msgpack.encode(WorkerNodeInfo(context.get_node_id(), ray.util.get_node_ip_address(),
                                                 os.getpid(), gpu_ids))


class RayWorkerWrapper:
    """The body of one worker actor: the engine's Worker, built once the executor knows the ranks."""

    def __init__(self) -> None:
        self.worker: Any = None

    def node_info(self) -> bytes:
        return node_info()

    def free_port(self) -> int:
        """A free TCP port on this node (torch.distributed's rendezvous, served by rank 0)."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def init_worker(self, config: Any, rank: int, local_rank: int, distributed_init_method: str | None,
                    cuda_visible_devices: str | None) -> None:
        if cuda_visible_devices is not None:
            # Every rank on a node sees all of the node's workers' GPUs and picks its own by local_rank.
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        from lm_console.engine.worker.worker import Worker

        self.worker = Worker(config, rank=rank, local_rank=local_rank,
                             distributed_init_method=distributed_init_method, is_driver_worker=rank == 0)

    def execute_method(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a Worker method by name, or a function with the worker first (collective_rpc)."""
        if isinstance(method, str):
            return getattr(self.worker, method)(*args, **kwargs)
        return method(self.worker, *args, **kwargs)

    def getpid(self) -> int:
        return os.getpid()

    def wait_forever(self) -> None:
        """Never returns: the executor's monitor learns of the actor's death when this call fails
        (the actor runs it in its second thread, max_concurrency=2)."""
        threading.Event().wait()
