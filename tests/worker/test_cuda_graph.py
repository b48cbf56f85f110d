"""Host-side parts of the GPU runner that run anywhere: capture sizes, padding, staging buffers.

Capture and replay themselves need CUDA; benchmarks/gpu_check.sh exercises them.
"""

from __future__ import annotations

import torch

from lm_console.engine.worker.cpu_gpu_buffer import CpuGpuBuffer, InputBuffers
from lm_console.engine.worker.cuda_graph import PAD_SLOT_ID, CudaGraphRunner, capture_sizes, pad_decode_inputs

CPU = torch.device("cpu")


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(256)[-3:] == [224, 240, 256]


def test_padded_size_is_the_smallest_capture_at_least_num_reqs():
    runner = CudaGraphRunner(torch.nn.Identity(), _buffers(40), 40, 16, 128)
    assert [runner.padded_size(n) for n in (1, 3, 8, 9, 33, 40, 41)] == [1, 4, 8, 16, 40, 40, None]


def test_pad_decode_inputs_adds_one_token_requests_that_write_nothing():
    b = _buffers(8)
    b.slot_mapping.np[:3] = [17, 40, 5]
    b.seq_lens.np[:3] = [18, 41, 6]
    b.query_start_loc.np[:4] = [0, 1, 2, 3]
    b.seq_lens.np[3:] = 99  # stale values of an earlier step
    pad_decode_inputs(b, 3, 8)
    assert b.slot_mapping.np[:8].tolist() == [17, 40, 5] + [PAD_SLOT_ID] * 5
    assert b.seq_lens.np[:8].tolist() == [18, 41, 6] + [1] * 5
    assert b.query_start_loc.np[:9].tolist() == list(range(9))


def test_cpu_buffer_device_side_is_the_host_tensor():
    buf = CpuGpuBuffer(4, 3, dtype=torch.int32, device=CPU)
    buf.np[1] = [1, 2, 3]
    assert buf.gpu is buf.cpu and not buf.cpu.is_pinned()
    assert buf.copy_to_gpu(2).tolist() == [[0, 0, 0], [1, 2, 3]]


def _buffers(max_num_seqs: int) -> InputBuffers:
    def buffer(*size: int, dtype: torch.dtype = torch.int64) -> CpuGpuBuffer:
        return CpuGpuBuffer(*size, dtype=dtype, device=CPU)

    return InputBuffers(
        input_ids=buffer(64), positions=buffer(64), slot_mapping=buffer(64),
        query_start_loc=buffer(max_num_seqs + 1, dtype=torch.int32),
        seq_lens=buffer(max_num_seqs, dtype=torch.int32),
        block_table=buffer(max_num_seqs, 8, dtype=torch.int32), logits_indices=buffer(max_num_seqs),
    )
