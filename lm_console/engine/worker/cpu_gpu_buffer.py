"""CpuGpuBuffer: a host tensor, its NumPy view and a device twin (after vLLM's CpuGpuBuffer).

On CUDA the host tensor is pinned, so `copy_to_gpu` is an asynchronous DMA that overlaps the
CPU work issued after it. On CPU the device twin IS the host tensor: no copy, no extra memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class CpuGpuBuffer:
    """A persistent staging buffer; callers fill `.np` (or `.cpu`), then call copy_to_gpu(n).

    Invariant: `.np` and `.cpu` share memory. The host side must not be rewritten while a copy
    issued from it may still be in flight; the runner's per-step synchronisation (reading the
    sampled tokens) guarantees that between steps.
    """

    def __init__(self, *size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.device = device
        on_cuda = device.type == "cuda"
        self.cpu = torch.zeros(*size, dtype=dtype, pin_memory=on_cuda)
        self.np: np.ndarray = self.cpu.numpy()
        self.gpu = torch.zeros_like(self.cpu, device=device) if on_cuda else self.cpu

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        """Issue the copy of the first n rows (all if None) and return the device rows."""
        if n is None:
            if self.gpu is not self.cpu:
                self.gpu.copy_(self.cpu, non_blocking=True)
            return self.gpu
        if self.gpu is not self.cpu:
            self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.gpu[:n]


@dataclass(slots=True)
class InputBuffers:
    """The ModelRunner's persistent staging buffers (host + device), shared with the graphs."""

    input_ids: CpuGpuBuffer  # [max_num_tokens] int64
    positions: CpuGpuBuffer  # [max_num_tokens] int64
    slot_mapping: CpuGpuBuffer  # [max_num_tokens] int64
    query_start_loc: CpuGpuBuffer  # [max_num_seqs + 1] int32
    seq_lens: CpuGpuBuffer  # [max_num_seqs] int32
    block_table: CpuGpuBuffer  # [max_num_seqs, max_blocks_per_req] int32 (the BlockTable's)
    logits_indices: CpuGpuBuffer  # [max_num_seqs] int64 (eager and graph steps alike)
