"""One step's model inputs: positions, token ids, slot mapping, attention metadata
(after vLLM's GPUModelRunner._prepare_inputs).

The ModelRunner's input preparation, apart from its forward pass: `prepare_inputs` stages a
step's tokens in the persistent CpuGpuBuffers (host writes, then asynchronous copies on CUDA) and
returns a StepInputs; `build_attention_metadata` turns it into the AttentionMetadata of an eager
forward (CUDA graph replays read the buffers directly).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lm_console.engine.attention.metadata import AttentionMetadata
from lm_console.engine.worker.block_table import BlockTable
from lm_console.engine.worker.cpu_gpu_buffer import InputBuffers
from lm_console.engine.worker.input_batch import InputBatch


@dataclass(slots=True)
class StepInputs:
    """One step's model inputs (what input preparation hands the forward pass).

    The host arrays are per request ([num_reqs]) or per token ([num_tokens]); the device
    tensors are rows of the runner's persistent buffers.
    """

    req_ids: list[str]
    num_tokens: int  # scheduled this step, all requests together
    max_query_len: int
    num_scheduled: np.ndarray  # [num_reqs] tokens each request computes
    cu_num_tokens: np.ndarray  # [num_reqs] running sum of num_scheduled
    num_computed: np.ndarray  # [num_reqs] tokens in the KV cache before this step
    seq_lens: np.ndarray  # [num_reqs] num_computed + num_scheduled
    req_indices: np.ndarray  # [num_tokens] each token's request row
    positions: np.ndarray  # [num_tokens]
    sample_rows: list[bool]  # False for a partial prefill, whose sample is discarded
    input_ids: torch.Tensor  # [num_tokens] on the device
    logits_indices: torch.Tensor  # [num_reqs] each request's last token, on the device
    inputs_embeds: torch.Tensor | None = None  # [num_tokens, hidden]: text + image embeddings
    # Speculative decoding: each request's drafts ([] for none) when some request verifies drafts.
    draft_token_ids: list[list[int]] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


def prepare_inputs(batch: InputBatch, buffers: InputBuffers, num_scheduled_tokens: dict[str, int]) -> StepInputs:
    """Stage the scheduled tokens of the batch's rows [0, num_reqs) in the buffers."""
    num_reqs = batch.num_reqs
    # Issue the block-table DMA first: it overlaps the CPU work below.
    batch.block_table.commit_block_table(num_reqs)
    req_ids = batch.req_ids[:num_reqs]  # a slice: already a copy
    num_scheduled = np.array([num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
    cu_num_tokens = np.cumsum(num_scheduled)
    total = int(cu_num_tokens[-1])
    req_indices = np.repeat(np.arange(num_reqs), num_scheduled)
    offsets = np.arange(total) - np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
    num_computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
    positions = num_computed[req_indices] + offsets
    seq_lens = num_computed + num_scheduled
    buffers.positions.np[:total] = positions
    buffers.input_ids.np[:total] = batch.token_ids_cpu[req_indices, positions]
    buffers.slot_mapping.np[:total] = batch.block_table[0].compute_slot_mapping(req_indices, positions)
    buffers.query_start_loc.np[0] = 0
    buffers.query_start_loc.np[1 : num_reqs + 1] = cu_num_tokens
    buffers.seq_lens.np[:num_reqs] = seq_lens
    buffers.logits_indices.np[:num_reqs] = cu_num_tokens - 1
    return StepInputs(
        req_ids=req_ids, num_tokens=total, max_query_len=int(num_scheduled.max()),
        num_scheduled=num_scheduled, cu_num_tokens=cu_num_tokens, num_computed=num_computed,
        seq_lens=seq_lens, req_indices=req_indices, positions=positions,
        sample_rows=(seq_lens >= batch.num_tokens[:num_reqs]).tolist(),
        input_ids=buffers.input_ids.copy_to_gpu(total),
        logits_indices=buffers.logits_indices.copy_to_gpu(num_reqs),
    )


def build_attention_metadata(inputs: StepInputs, buffers: InputBuffers, block_table: BlockTable,
                             block_size: int,
                             metadata_cls: type[AttentionMetadata] = AttentionMetadata) -> AttentionMetadata:
    """The metadata every attention layer reads in an eager forward (KV cache group 0's table),
    of the attention backend's own class."""
    num_reqs = inputs.num_reqs
    return metadata_cls(
        num_actual_tokens=inputs.num_tokens,
        num_reqs=num_reqs,
        query_start_loc=buffers.query_start_loc.copy_to_gpu(num_reqs + 1),
        seq_lens=buffers.seq_lens.copy_to_gpu(num_reqs),
        block_table=block_table.get_device_tensor(num_reqs),
        slot_mapping=buffers.slot_mapping.copy_to_gpu(inputs.num_tokens),
        max_query_len=inputs.max_query_len,
        max_seq_len=int(inputs.seq_lens.max()),
        query_start_loc_cpu=[0, *inputs.cu_num_tokens.tolist()],
        seq_lens_cpu=inputs.seq_lens.tolist(),
        block_size=block_size,
    )


def verification_logits_indices(inputs: StepInputs, device: torch.device) -> torch.Tensor:
    """The hidden-state rows whose logits a draft-verifying step needs: each request's last
    len(drafts) + 1 tokens (its real token and its drafts), requests in order."""
    assert inputs.draft_token_ids is not None
    indices: list[int] = []
    for last, drafts in zip(inputs.cu_num_tokens.tolist(), inputs.draft_token_ids):
        indices.extend(range(last - 1 - len(drafts), last))
    return torch.tensor(indices, dtype=torch.int64).to(device, non_blocking=True)


def verification_attention_metadata(inputs: StepInputs, block_table: BlockTable, block_size: int,
                                    metadata_cls: type[AttentionMetadata], device: torch.device) -> AttentionMetadata:
    """Attention metadata of a step that verifies drafts: a request's real token and its drafts
    each become a decode row of their own (query length 1, its sequence length its position + 1,
    the request's block table row), other requests keep their row.

    Causality comes from the sequence lengths, and every backend writes the step's K/V into the
    cache before it attends, so a draft row sees the K/V of the tokens before it in the same
    step. The step then looks like plain decode rows to the kernels: the C decode stack and the
    decode attention kernel serve it as they serve decoding, at up to their row limits.
    """
    assert inputs.draft_token_ids is not None
    num_reqs = inputs.num_reqs
    starts = (inputs.cu_num_tokens - inputs.num_scheduled).tolist()
    query_lens: list[int] = []
    row_reqs: list[int] = []
    seq_lens: list[int] = []
    for i, drafts in enumerate(inputs.draft_token_ids):
        start, count = starts[i], int(inputs.num_scheduled[i])
        if drafts:
            split = count - len(drafts) - 1  # tokens before the real one (none at decode)
            if split > 0:
                query_lens.append(split)
                row_reqs.append(i)
                seq_lens.append(int(inputs.positions[start + split - 1]) + 1)
            for offset in range(max(split, 0), count):
                query_lens.append(1)
                row_reqs.append(i)
                seq_lens.append(int(inputs.positions[start + offset]) + 1)
        else:
            query_lens.append(count)
            row_reqs.append(i)
            seq_lens.append(int(inputs.seq_lens[i]))
    num_rows = len(query_lens)
    cu = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq_lens_np = np.asarray(seq_lens, dtype=np.int32)
    table = block_table.get_device_tensor(num_reqs)
    if num_rows != num_reqs or row_reqs != list(range(num_reqs)):
        table = table.index_select(0, torch.tensor(row_reqs, dtype=torch.int64, device=table.device)).contiguous()
    slot_mapping = torch.from_numpy(
        block_table.compute_slot_mapping(inputs.req_indices, inputs.positions).astype(np.int64)).to(device)
    return metadata_cls(
        num_actual_tokens=inputs.num_tokens,
        num_reqs=num_rows,
        query_start_loc=torch.from_numpy(cu).to(device),
        seq_lens=torch.from_numpy(seq_lens_np).to(device),
        block_table=table,
        slot_mapping=slot_mapping,
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens_np.max()),
        query_start_loc_cpu=cu.tolist(),
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )
