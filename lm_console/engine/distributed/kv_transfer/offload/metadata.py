"""OffloadConnectorMetadata: the scheduler side's load and save instructions for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from lm_console.engine.distributed.kv_transfer.base import KVConnectorMetadata


@dataclass(slots=True)
class ChunkLoad:
    """Copy tokens [token_offset, token_offset + len(block_ids) * block_size) of a chunk into block_ids."""

    key: bytes
    token_offset: int
    block_ids: list[int]
    pinned: bool  # the scheduler pinned the chunk in the CPU tier; the loader unpins it


@dataclass(slots=True)
class ChunkSave:
    """Store the chunk held by block_ids (a whole chunk, in order) under key."""

    key: bytes
    parent: bytes | None
    block_ids: list[int]
    token_ids: list[int]


@dataclass
class OffloadConnectorMetadata(KVConnectorMetadata):
    """loads: request id -> its chunks to load asynchronously (the request waits off the forward);
    layer_loads: chunks to load during this step's forward, layer by layer (CPU-tier hits of
    requests in this step); saves: chunks computed this step."""

    loads: dict[str, list[ChunkLoad]] = field(default_factory=dict)
    layer_loads: dict[str, list[ChunkLoad]] = field(default_factory=dict)
    saves: list[ChunkSave] = field(default_factory=list)
