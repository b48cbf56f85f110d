"""BlockTable: per-row block ids and the slot mapping (after vLLM's vllm/v1/worker/block_table.py)."""

from __future__ import annotations

import numpy as np
import torch

from lm_console.engine.worker.cpu_gpu_buffer import CpuGpuBuffer


class BlockTable:
    """Rows of physical block ids for the requests of the persistent batch.

    slot = block_number * block_size + position % block_size; the host copy is edited in place
    and committed to the device once per step (commit_block_table), before the step's other
    CPU work so the DMA overlaps it. On CPU the device tensor is the host tensor.
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.buffer = CpuGpuBuffer(max_num_reqs, max_num_blocks_per_req, dtype=torch.int32,
                                   device=device)
        self.block_table_np = self.buffer.np  # [max_num_reqs, max_num_blocks_per_req] int32
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        self.device = device

    def add_row(self, block_ids: list[int], row_idx: int) -> None:
        self.num_blocks_per_row[row_idx] = 0
        self.append_row(block_ids, row_idx)

    def append_row(self, block_ids: list[int], row_idx: int) -> None:
        if not block_ids:
            return
        start = self.num_blocks_per_row[row_idx]
        end = start + len(block_ids)
        self.block_table_np[row_idx, start:end] = block_ids
        self.num_blocks_per_row[row_idx] = end

    def move_row(self, src: int, tgt: int) -> None:
        num_blocks = self.num_blocks_per_row[src]
        self.block_table_np[tgt, :num_blocks] = self.block_table_np[src, :num_blocks]
        self.num_blocks_per_row[tgt] = num_blocks

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Slots for tokens at `positions` of the rows `req_indices` (both [num_tokens])."""
        block_numbers = self.block_table_np[req_indices, positions // self.block_size]
        return block_numbers.astype(np.int64) * self.block_size + positions % self.block_size

    def commit_block_table(self, num_reqs: int) -> None:
        """Issue the (asynchronous) host-to-device copy of rows [0, num_reqs)."""
        self.buffer.copy_to_gpu(num_reqs)

    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        """[num_reqs, widest row's blocks] int32 view of the committed device table."""
        max_blocks = int(self.num_blocks_per_row[:num_reqs].max()) if num_reqs else 0
        return self.buffer.gpu[:num_reqs, :max(max_blocks, 1)]


class MultiGroupBlockTable:
    """One BlockTable per KV cache group (after vLLM's MultiGroupBlockTable).

    block_ids arguments are tuples with one list per group, as the scheduler sends them.
    A model with a single group (every full-attention model) has exactly one table, so the
    per-step cost is the single-table cost plus a loop of length one.
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int,
                 device: torch.device, num_kv_cache_groups: int = 1) -> None:
        self.block_tables = [BlockTable(max_num_reqs, max_num_blocks_per_req, block_size, device)
                             for _ in range(num_kv_cache_groups)]

    def __getitem__(self, kv_cache_group_id: int) -> BlockTable:
        return self.block_tables[kv_cache_group_id]

    def __len__(self) -> int:
        return len(self.block_tables)

    def add_row(self, block_ids: tuple[list[int], ...], row_idx: int) -> None:
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.add_row(ids, row_idx)

    def append_row(self, block_ids: tuple[list[int], ...], row_idx: int) -> None:
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.append_row(ids, row_idx)

    def move_row(self, src: int, tgt: int) -> None:
        for table in self.block_tables:
            table.move_row(src, tgt)

    def commit_block_table(self, num_reqs: int) -> None:
        """Issue every group's host-to-device copy of rows [0, num_reqs)."""
        for table in self.block_tables:
            table.commit_block_table(num_reqs)
