"""AttentionMetadata: what every attention layer needs to know about the current batch.

The fields every backend reads; a backend that keeps more per step subclasses it (its
`metadata_cls`, e.g. the torch backend's TorchAttentionMetadata).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class AttentionMetadata:
    """Layout of one model step's tokens in the paged KV cache.

    Tokens of request i are q[query_start_loc[i]:query_start_loc[i+1]]; they are the last
    query_len tokens of a sequence of seq_lens[i] tokens, so they attend causally to each other
    and fully to the seq_lens[i] - query_len tokens already in the cache. Rows with
    query_len == 1 (decodes) may sit anywhere in the batch.

    Invariant: query_start_loc_cpu / seq_lens_cpu equal the device tensors; slot_mapping holds
    block_number * block_size + position % block_size for each token, -1 for a padding token
    whose K/V must not be written.
    """

    num_actual_tokens: int  # tokens really scheduled; q may carry padding rows after them
    num_reqs: int
    query_start_loc: Tensor  # [num_reqs + 1] int32, on device
    seq_lens: Tensor  # [num_reqs] int32: num_computed_tokens + num_scheduled_tokens
    block_table: Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: Tensor  # [num_tokens] int64, -1 = skip
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # Multimodal models with bidirectional attention within an image (Gemma3): request row ->
    # [(start, end)] token positions that attend each other both ways, for prefill rows whose
    # new tokens reach into such a span; None (or no entry) = plain causal.
    bidirectional_spans: dict[int, list[tuple[int, int]]] | None = None
