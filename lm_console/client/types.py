"""Plain data the console gets from an engine client: engine info, stats, KV events, stream chunks.

The console owns these types (and not the engine's) so the TUI imports no torch and keeps working
while the engine's own structures evolve: the adapter converts, the fake builds them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# One byte a block in StatsSample.block_states.
BLOCK_FREE = 0
BLOCK_IN_USE = 1
BLOCK_CACHED = 2  # in the prefix cache, no request holds it: evictable
BLOCK_NULL = 3


class EngineUnavailable(Exception):
    """The engine failed to start or died; `hint` says what the user can do about it."""

    def __init__(self, message: str, hint: str = "", *, during_start: bool = False) -> None:
        super().__init__(message)
        self.hint = hint
        self.during_start = during_start


@dataclass(slots=True)
class EngineInfo:
    """What the header shows about the running engine."""

    model: str = "?"
    device: str = "cpu"
    dtype: str = "?"
    block_size: int = 16
    num_blocks: int = 0
    max_model_len: int = 0
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    vocab_size: int = 32000
    multimodal: bool = False
    notice: str | None = None  # shown beside the model name (e.g. the demo VLM's caveat)
    url: str | None = None  # the server the console is attached to (lmc tui --url)
    # Panels whose data this engine does not publish -> what the panel says instead of zeros.
    # Keys: UNAVAILABLE_* below.
    unavailable: dict[str, str] = field(default_factory=dict)


# Keys of EngineInfo.unavailable: the panels a remote server may have no source for.
UNAVAILABLE_BLOCK_MAP = "block_map"
UNAVAILABLE_STEPS = "steps"  # per-step scheduler stats: token budget, tokens/step, step time
UNAVAILABLE_KV_EVENTS = "kv_events"
UNAVAILABLE_REQUESTS = "requests"  # the server's own request table


@dataclass(slots=True)
class KVTierSample:
    """One KV offload tier (CPU or DISK) as the engine reports it: occupancy, cumulative counters."""

    medium: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    num_chunks: int = 0
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0  # stored into the tier
    bytes_out: int = 0  # loaded from the tier
    evictions: int = 0
    errors: int = 0


@dataclass(slots=True)
class StatsSample:
    """One SchedulerStats snapshot (one engine step), plus the block map when it was sent."""

    ts: float
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_preempted_reqs: int = 0  # preemptions during this step
    num_preemptions_total: int | None = None  # since start, when the engine counts them
    num_scheduled_tokens: int = 0
    token_budget: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_requests: int = 0
    prefix_queries: int = 0  # tokens looked up in the prefix cache during this step
    prefix_hits: int = 0  # of which found
    step_time_s: float = 0.0
    num_steps: int = 0
    num_prompt_tokens: int | None = None  # when the engine reports the split itself
    num_generation_tokens: int | None = None
    block_states: bytes | None = None  # one byte a block: BLOCK_FREE .. BLOCK_NULL
    block_ref_counts: bytes | None = None  # one byte a block, saturating at 255
    encoder_cache: EncoderCacheSample | None = None  # multimodal engines only
    kv_tiers: list[KVTierSample] | None = None  # KV offload tiers, when a connector offloads
    # False for a sample that is not one engine step (a /metrics poll, an idle snapshot): its
    # counters still count, but it does not count as a step.
    is_step: bool = True


@dataclass(slots=True)
class EncoderCacheSample:
    """The encoder cache after one step: occupancy in embedding slots, cumulative counters."""

    num_entries: int = 0
    num_slots: int = 0
    num_used_slots: int = 0
    num_freeable_slots: int = 0
    num_free_slots: int = 0
    num_lookups: int = 0
    num_hits: int = 0
    num_encoder_runs: int = 0
    num_external_loads: int = 0
    num_evictions: int = 0


@dataclass(slots=True)
class KVEventRecord:
    """One KV cache event, flattened for display and for `lmc events`."""

    ts: float
    kind: str  # "BlockStored" | "BlockRemoved" | "AllBlocksCleared"
    block_hashes: list[str] = field(default_factory=list)  # hex digests
    parent_block_hash: str | None = None
    num_tokens: int = 0
    block_size: int = 0
    medium: str | None = "GPU"
    seq: int = 0

    def to_json_dict(self) -> dict[str, Any]:
        """The record as `lmc events` prints it."""
        return {
            "ts": self.ts, "seq": self.seq, "type": self.kind, "block_hashes": self.block_hashes,
            "parent_block_hash": self.parent_block_hash, "num_tokens": self.num_tokens,
            "block_size": self.block_size, "medium": self.medium,
        }


@dataclass(slots=True)
class GenParams:
    """The sampling settings the console exposes (a subset of SamplingParams)."""

    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int = 256
    seed: int | None = None
    ignore_eos: bool = False


@dataclass(slots=True)
class StreamChunk:
    """What one request produced since its previous chunk."""

    request_id: str
    text: str = ""
    num_new_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    ttft_s: float | None = None  # engine-measured, when known
    tpot_s: float | None = None
    e2e_s: float | None = None
