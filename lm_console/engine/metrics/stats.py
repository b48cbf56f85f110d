"""Stats the engine reports (what the console and /metrics read).

SchedulerStats and BlockPoolState come from the engine core (msgspec: they cross the process
boundary); IterationStats is counted by the frontend's OutputProcessor, one per batch of outputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

# SchedulerStats.block_states: one byte a block (BlockPool.get_block_states, the console's block map).
BLOCK_STATE_FREE = 0  # ref_cnt == 0, no hash: plain free block
BLOCK_STATE_IN_USE = 1  # ref_cnt > 0
BLOCK_STATE_CACHED = 2  # ref_cnt == 0 with a hash: free but still a prefix-cache hit (evictable)
BLOCK_STATE_NULL = 3  # the null block


class PrefixCacheStatsSnapshot(msgspec.Struct, array_like=True, gc=False):
    """Prefix-cache lookups since the last snapshot, counted in tokens."""

    requests: int = 0
    queries: int = 0
    hits: int = 0


class EncoderCacheStats(msgspec.Struct, array_like=True, gc=False):
    """The encoder cache: occupancy in embedding slots, cumulative counters."""

    num_entries: int = 0
    num_slots: int = 0
    num_used_slots: int = 0  # referenced by a request
    num_freeable_slots: int = 0  # unreferenced, kept until the space is needed
    num_free_slots: int = 0
    num_lookups: int = 0
    num_hits: int = 0
    num_encoder_runs: int = 0
    num_external_loads: int = 0
    num_evictions: int = 0
class KVTierStats(msgspec.Struct, array_like=True, gc=False):
    """One KV offload tier (medium CPU or DISK): occupancy and cumulative counters.

    hits/misses count chunk lookups (a DISK lookup happens only after a CPU miss); bytes_in
    were stored into the tier, bytes_out loaded from it; errors: corrupt chunks, failed writes.
    """

    medium: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    num_chunks: int = 0
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    errors: int = 0


# Histogram buckets (seconds) of the sampled block residency metrics: /metrics and the console.
KV_BLOCK_RESIDENCY_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0,
                              30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0]


class KVBlockResidencyStats(msgspec.Struct, array_like=True, gc=False):
    """Sampled KV block observations since the last step (lm_console/engine/core/kv_cache/block_metrics.py)."""

    lifetimes_s: list[float] = msgspec.field(default_factory=list)  # allocation -> eviction
    idle_before_evict_s: list[float] = msgspec.field(default_factory=list)  # last access -> eviction
    reuse_gaps_s: list[float] = msgspec.field(default_factory=list)  # between consecutive accesses


class LoRAStats(msgspec.Struct, array_like=True, gc=False):
    """The adapters of the running and the waiting requests (vLLM's vllm:lora_requests_info)."""

    max_lora: int
    running_lora_adapters: list[str] = []  # adapter names, each once, in order of first use
    waiting_lora_adapters: list[str] = []


class SpecDecodingStats(msgspec.Struct, array_like=True, gc=False):
    """Speculative decoding since the engine started (vLLM's spec_decode counters): cumulative,
    so a reader that misses snapshots loses nothing."""

    num_spec_tokens: int = 0  # num_speculative_tokens: the positions below
    num_drafts: int = 0  # request-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)  # [num_spec_tokens]

    @classmethod
    def new(cls, num_spec_tokens: int) -> SpecDecodingStats:
        """Zero counters for num_spec_tokens positions."""
        return cls(num_spec_tokens=num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request-step: num_draft_tokens verified, the first num_accepted_tokens accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[position] += 1

    def copy(self) -> SpecDecodingStats:
        """A snapshot that later observations do not change."""
        return SpecDecodingStats(self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos))

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens (None before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verifying request-step, the target's own included (vLLM's mean
        acceptance length; None before any)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


class SchedulerStats(msgspec.Struct, array_like=True, gc=False):
    """Scheduler and KV cache state after one step (the console's main feed).

    block_states / block_ref_counts (one byte a block, see BlockPool.get_block_states) are set
    at most about 4 times a second; None otherwise.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_preempted_reqs: int = 0  # preemptions during this step
    num_scheduled_tokens: int = 0
    token_budget: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0  # usable blocks (the null block excluded)
    prefix_cache: PrefixCacheStatsSnapshot = msgspec.field(default_factory=PrefixCacheStatsSnapshot)
    step_time_s: float = 0.0
    num_steps: int = 0
    num_prompt_tokens: int = 0  # scheduled tokens of this step that were prompt (prefill) tokens
    num_generation_tokens: int = 0  # tokens sampled in this step
    num_preemptions_total: int = 0
    timestamp: float = 0.0  # time.time() when the snapshot was taken
    block_states: bytes | None = None
    block_ref_counts: bytes | None = None
    encoder_cache: EncoderCacheStats | None = None  # multimodal models only
    kv_tiers: list[KVTierStats] | None = None  # KV offload tiers (kv_transfer_config), else None
    engine_index: int = 0  # the engine core's data_parallel_rank (several cores: data parallelism)
    kv_block_residency: KVBlockResidencyStats | None = None  # kv_cache_metrics: this step's observations
    lora: LoRAStats | None = None  # enable_lora only
    spec_decoding: SpecDecodingStats | None = None  # speculative decoding (cumulative), else None


# The SchedulerStats fields that describe one step (not the engine's state after it): a merged
# view of several engine cores (data parallelism) takes them from the step it reports.
PER_STEP_FIELDS = ("num_preempted_reqs", "num_scheduled_tokens", "prefix_cache", "step_time_s",
                   "num_prompt_tokens", "num_generation_tokens", "timestamp", "kv_tiers", "encoder_cache",
                   "kv_block_residency")


class BlockPoolState(msgspec.Struct, array_like=True, gc=False):
    """A cheap view of the BlockPool for the console and for leak checks (utility call)."""

    num_blocks: int  # blocks in the pool, the null block 0 included
    num_free_blocks: int  # free, cached-and-evictable ones included
    num_cached_blocks: int  # blocks in the prefix cache, in use or not
    num_running_reqs: int
    num_waiting_reqs: int
    block_states: bytes
    block_ref_counts: bytes

    @property
    def num_total_blocks(self) -> int:
        """Usable blocks: all but the null block."""
        return self.num_blocks - 1

    @property
    def all_free(self) -> bool:
        """No request holds a block and none is queued (the no-leak condition)."""
        return (self.num_free_blocks == self.num_total_blocks
                and self.num_running_reqs == 0 and self.num_waiting_reqs == 0)


class RequestBlocks(msgspec.Struct, array_like=True, gc=False):
    """One unfinished request in the engine core: its scheduler state and its KV blocks."""

    request_id: str
    status: str  # "WAITING" | "RUNNING" | "PREEMPTED" | "WAITING_FOR_REMOTE_KVS" | ...
    num_preemptions: int
    num_prompt_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int  # prefix-cache hit at its first scheduling (-1 before it)
    block_ids: list[list[int]]  # per KV cache group, in token order (the null block 0 where skipped)
    lora_name: str | None = None  # its LoRA adapter (None: the base model)


class RequestBlocksState(msgspec.Struct, array_like=True, gc=False):
    """The core's unfinished requests with their blocks (the console's request inspector).

    block_hashes: block id -> the block's prefix-cache hash, for every hashed block the requests
    hold and for the extra block ids asked for; an unhashed block is absent.
    """

    requests: list[RequestBlocks]
    block_hashes: dict[int, bytes]


@dataclass(slots=True)
class FinishedRequestStats:
    """One finished request's phases in seconds (vLLM's per-request histograms).

    queued_time: QUEUED -> first SCHEDULED; prefill_time: first SCHEDULED -> first token;
    decode_time: first -> last token; inference_time: first SCHEDULED -> last token.
    A phase the request never reached counts as 0.
    """

    finish_reason: str  # "stop" | "length" | "abort"
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    queued_time: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    inference_time: float = 0.0
    # The request's n and max_tokens as the engine ran it (vLLM's request_params_* histograms); None on
    # the 2nd..nth child of an n > 1 request, so that each user request is observed once.
    n_param: int | None = None
    max_tokens_param: int | None = None


@dataclass(slots=True)
class IterationStats:
    """What the frontend saw in one batch of EngineCoreOutputs (feeds the stat loggers)."""

    iteration_timestamp: float = field(default_factory=time.time)
    num_prompt_tokens: int = 0  # prompts whose first token arrived in this batch
    num_generation_tokens: int = 0
    num_finished_requests: int = 0
    num_preempted_reqs: int = 0  # PREEMPTED events seen in this batch
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    e2e_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
