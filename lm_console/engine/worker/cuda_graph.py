"""CUDA graphs for decode steps.

A pure-decode step (every request schedules one token) is replayed from a graph captured for
the smallest capture size >= num_reqs. The batch is padded to that size with 1-token requests
of length 1 whose slot is PAD_SLOT_ID (-1): reshape_and_cache skips them, and their output rows
are dropped. Graphs read only the runner's persistent device buffers, refreshed before replay.
"""

from __future__ import annotations

import bisect
import torch
from torch import nn

from lm_console.engine.attention.metadata import AttentionMetadata
from lm_console.engine.forward_context import set_forward_context
from lm_console.engine.worker.cpu_gpu_buffer import InputBuffers

PAD_SLOT_ID = -1


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then multiples of 16 up to max_num_seqs (inclusive)."""
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def pad_decode_inputs(buffers: InputBuffers, num_reqs: int, size: int) -> None:
    """Host side: turn rows [num_reqs, size) into padding requests (1 token, length 1, slot -1).

    Rows [0, num_reqs) must already hold the step's decodes (one token each). Block-table rows
    of padding requests keep whatever valid block ids they hold; only entry 0 is ever read.
    """
    buffers.input_ids.np[num_reqs:size] = 0
    buffers.positions.np[num_reqs:size] = 0
    buffers.slot_mapping.np[num_reqs:size] = PAD_SLOT_ID
    buffers.seq_lens.np[num_reqs:size] = 1
    buffers.query_start_loc.np[num_reqs + 1 : size + 1] = range(num_reqs + 1, size + 1)


class CudaGraphRunner:
    """One captured decode forward per capture size, replayed over the shared buffers.

    Invariant: graph[size] reads rows [0, size) of every buffer and writes outputs[size]
    ([size, hidden_size]); all graphs share one memory pool (captured largest first).
    """

    def __init__(self, model: nn.Module, buffers: InputBuffers, max_num_seqs: int,
                 block_size: int, max_model_len: int) -> None:
        self.model = model
        self.buffers = buffers
        self.sizes = capture_sizes(max_num_seqs)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def padded_size(self, num_reqs: int) -> int | None:
        """The capture size a decode batch of num_reqs replays with (None: too large)."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def _metadata(self, size: int) -> AttentionMetadata:
        b = self.buffers
        return AttentionMetadata(
            num_actual_tokens=size, num_reqs=size,
            query_start_loc=b.query_start_loc.gpu[: size + 1], seq_lens=b.seq_lens.gpu[:size],
            block_table=b.block_table.gpu[:size], slot_mapping=b.slot_mapping.gpu[:size],
            max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(size + 1)), seq_lens_cpu=[1] * size,
            block_size=self.block_size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool."""
        largest = self.sizes[-1]
        pad_decode_inputs(self.buffers, 0, largest)  # all padding: valid, harmless values
        for buffer in (self.buffers.input_ids, self.buffers.positions, self.buffers.slot_mapping,
                       self.buffers.seq_lens):
            buffer.copy_to_gpu(largest)
        self.buffers.query_start_loc.copy_to_gpu(largest + 1)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            md = self._metadata(size)
            input_ids = self.buffers.input_ids.gpu[:size]
            positions = self.buffers.positions.gpu[:size]
            with set_forward_context(md):  # warm-up: compile kernels, create cuBLAS handles
                self.model(input_ids, positions)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), set_forward_context(md):
                self.outputs[size] = self.model(input_ids, positions)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def replay(self, num_reqs: int, size: int) -> torch.Tensor:
        """Pad the host rows, copy rows [0, size) up, replay; returns [num_reqs, hidden]."""
        b = self.buffers
        pad_decode_inputs(b, num_reqs, size)
        for buffer in (b.input_ids, b.positions, b.slot_mapping, b.seq_lens):
            buffer.copy_to_gpu(size)
        b.query_start_loc.copy_to_gpu(size + 1)
        self.graphs[size].replay()
        return self.outputs[size][:num_reqs]
