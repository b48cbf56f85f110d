"""InputBatch: the persistent batch of the ModelRunner (after vLLM's InputBatch)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from lm_console.engine.lora.request import LoRARequest
from lm_console.engine.sampling_params import SamplingParams
from lm_console.engine.worker.block_table import MultiGroupBlockTable


@dataclass(slots=True)
class CachedRequestState:
    """The worker's copy of one request, kept across steps (after vLLM's CachedRequestState)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: tuple[list[int], ...]  # one list per KV cache group
    num_computed_tokens: int
    mm_features: list = field(default_factory=list)
    lora_request: LoRARequest | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    """Rows [0, num_reqs) hold the running requests; removals leave holes that condense() fills.

    Row-indexed NumPy arrays (token ids, progress) and the BlockTable persist across steps, so
    each step only writes what changed.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 device: torch.device, num_kv_cache_groups: int = 1) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        max_num_blocks = -(-max_model_len // block_size)
        self.block_table = MultiGroupBlockTable(max_num_reqs, max_num_blocks, block_size, device,
                                                num_kv_cache_groups)
        self.states: list[CachedRequestState | None] = [None] * max_num_reqs
        self._num_rows = 0  # one past the highest occupied row
        self.batch_changed = True  # sampling metadata must be rebuilt

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, state: CachedRequestState) -> int:
        """Put a request in the first free row and return it."""
        row = next(i for i in range(self.max_num_reqs) if self.req_ids[i] is None)
        self.req_ids[row] = state.req_id
        self.req_id_to_index[state.req_id] = row
        self.states[row] = state
        num_prompt = len(state.prompt_token_ids)
        self.token_ids_cpu[row, :num_prompt] = state.prompt_token_ids
        num_output = len(state.output_token_ids)
        self.token_ids_cpu[row, num_prompt:num_prompt + num_output] = state.output_token_ids
        self.num_tokens[row] = num_prompt + num_output
        self.num_computed_tokens_cpu[row] = state.num_computed_tokens
        self.block_table.add_row(state.block_ids, row)
        self._num_rows = max(self._num_rows, row + 1)
        self.batch_changed = True
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Free the request's row (leaving a hole) and return it, or None if absent."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.req_ids[row] = None
        self.states[row] = None
        self.batch_changed = True
        return row

    def append_token(self, row: int, token_id: int) -> None:
        position = self.num_tokens[row]
        self.token_ids_cpu[row, position] = token_id
        self.num_tokens[row] = position + 1

    def condense(self) -> None:
        """Move the last rows into the holes so rows [0, num_reqs) are occupied."""
        num_reqs = self.num_reqs
        last = self._num_rows - 1
        for hole in range(num_reqs):
            if self.req_ids[hole] is not None:
                continue
            while self.req_ids[last] is None:
                last -= 1
            if last <= hole:
                break
            self._move_row(last, hole)
            last -= 1
        self._num_rows = num_reqs

    def _move_row(self, src: int, tgt: int) -> None:
        req_id = self.req_ids[src]
        assert req_id is not None
        num_tokens = self.num_tokens[src]
        self.token_ids_cpu[tgt, :num_tokens] = self.token_ids_cpu[src, :num_tokens]
        self.num_tokens[tgt] = num_tokens
        self.num_computed_tokens_cpu[tgt] = self.num_computed_tokens_cpu[src]
        self.block_table.move_row(src, tgt)
        self.req_ids[tgt], self.req_ids[src] = req_id, None
        self.states[tgt], self.states[src] = self.states[src], None
        self.req_id_to_index[req_id] = tgt
        self.batch_changed = True
