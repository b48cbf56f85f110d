"""The tensor-parallel group: torch.distributed with gloo on CPU, NCCL on CUDA.

Each worker process calls init_distributed() once (Worker.init_device); the model's parallel
layers then reach their group through get_tp_group(). A process that never initialised (one
worker, no TP) gets a group of one whose collectives return their input: the same model code
serves TP=1 without any torch.distributed set-up.

Module state: the one group of this process, set once at start-up (as the forward context is
the per-step state); nothing else here is mutable.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GroupCoordinator:
    """A process group and the collectives the model needs, with world_size 1 as a no-op."""

    def __init__(self, rank: int = 0, world_size: int = 1, group: dist.ProcessGroup | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along dim, in rank order, on every rank."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every rank's x concatenated along dim on rank dst; None on the others."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == dst else None
        dist.gather(x.contiguous(), parts, dst=dst, group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank src's x on every rank (in place); returns x."""
        if self.world_size > 1:
            dist.broadcast(x, src=src, group=self.group)
        return x


_TP_GROUP = GroupCoordinator()


def init_distributed(world_size: int, rank: int, init_method: str | None, backend: str | None = None,
                     local_rank: int = 0) -> GroupCoordinator:
    """Join the tensor-parallel group (all ranks call it together); world_size 1: no group.

    backend None: NCCL when CUDA is available, gloo otherwise. The whole world is the TP group
    (no pipeline or data parallelism inside one engine core).
    """
    global _TP_GROUP
    if world_size == 1:
        _TP_GROUP = GroupCoordinator()
        return _TP_GROUP
    if init_method is None:
        raise ValueError("tensor parallelism needs a distributed_init_method (tcp://host:port)")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method, world_size=world_size, rank=rank)
    _TP_GROUP = GroupCoordinator(rank, world_size, dist.group.WORLD)
    return _TP_GROUP


def get_tp_group() -> GroupCoordinator:
    """This process's tensor-parallel group (a group of one before init_distributed)."""
    return _TP_GROUP


def destroy_distributed() -> None:
    """Leave the process group (idempotent)."""
    global _TP_GROUP
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP = GroupCoordinator()
