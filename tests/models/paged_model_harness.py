"""A minimal stand-in for the model runner: block allocation, metadata, one model step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lm_console.engine.attention import AttentionMetadata, bind_kv_caches, get_attention_layers
from lm_console.engine.attention import get_kv_cache_shape
from lm_console.engine.forward_context import set_forward_context


@dataclass
class _Seq:
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0


class PagedHarness:
    """Owns the KV caches of `model` and runs steps of (request id, new token ids) chunks."""

    def __init__(self, model: nn.Module, num_blocks: int = 64, block_size: int = 16,
                 seed: int = 0, kv_cache_dtype: torch.dtype | None = None) -> None:
        self.model, self.block_size = model, block_size
        layers = get_attention_layers(model)
        dtype = kv_cache_dtype or next(model.parameters()).dtype  # torch.int8: the int8 cache
        self.kv_caches = [
            torch.zeros(get_kv_cache_shape(num_blocks, block_size, a.num_kv_heads, a.head_dim,
                                           int8=dtype == torch.int8), dtype=dtype) for a in layers
        ]
        bind_kv_caches(model, self.kv_caches)
        # Hand out blocks in a shuffled order (never block 0) so tables are not contiguous.
        gen = torch.Generator().manual_seed(seed)
        self.free_blocks = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.seqs: dict[str, _Seq] = {}

    def step(self, chunks: list[tuple[str, list[int]]]) -> Tensor:
        """Run one step; returns float32 logits of every scheduled token [num_tokens, vocab]."""
        input_ids, positions, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        for req_id, token_ids in chunks:
            seq = self.seqs.setdefault(req_id, _Seq())
            end = seq.num_computed + len(token_ids)
            while len(seq.block_ids) * self.block_size < end:
                seq.block_ids.append(self.free_blocks.pop())
            for pos in range(seq.num_computed, end):
                block = seq.block_ids[pos // self.block_size]
                slots.append(block * self.block_size + pos % self.block_size)
            input_ids += token_ids
            positions += range(seq.num_computed, end)
            seq.num_computed = end
            qsl.append(len(input_ids))
            seq_lens.append(end)
            tables.append(seq.block_ids)
        width = max(len(t) for t in tables)
        block_table = torch.zeros(len(chunks), width, dtype=torch.int32)
        for i, table in enumerate(tables):
            block_table[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        md = AttentionMetadata(
            num_actual_tokens=len(input_ids),
            num_reqs=len(chunks),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=block_table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            block_size=self.block_size,
        )
        with torch.inference_mode(), set_forward_context(md):
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions))
            return self.model.compute_logits(hidden)
