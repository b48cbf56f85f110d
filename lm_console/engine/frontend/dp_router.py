"""DPRouter: which engine core gets a request under data parallelism (vLLM: the DP coordinator's load balancing).

The frontend knows two things about each core: the gauges of its latest SchedulerStats
(waiting, running, KV usage) and the requests it has sent there and not yet seen finish (the
stats lag a step; this count does not). least_loaded picks the core with the smallest
4 * queued + running, queued being what the core has not started yet, then the lowest KV
usage, then the lowest index (vLLM weighs waiting requests 4x too: they cost a whole prefill).

prefix additionally follows each core's prefix cache through its KV events (BlockStored,
BlockRemoved, AllBlocksCleared), computes the request's block hashes as that core does (its
hash chain's root comes in the ready handshake) and prefers the core holding the longest
cached prefix, among those tied the least loaded. A prefix hit saves a prefill but a queue
costs more: when the best-matching core has requests queued and another core has none, the
request goes to the least-loaded core instead.

Thread-safe: the frontend routes and aborts, each core's output reader observes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lm_console.engine.kv_cache_hashing import generate_block_hash_extra_keys, get_hash_fn_by_name, hash_block_tokens
from lm_console.engine.metrics.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from lm_console.engine.protocol import EngineCoreOutputs, EngineCoreRequest

ROUTING_POLICIES = ("least_loaded", "prefix")
_QUEUED_WEIGHT = 4


@dataclass(slots=True)
class CoreLoad:
    """What the frontend knows about one engine core."""

    num_waiting: int = 0  # from the core's latest SchedulerStats
    num_running: int = 0
    kv_cache_usage: float = 0.0
    in_flight: set[str] = field(default_factory=set)  # sent here, not yet seen finish
    num_routed: int = 0  # requests ever routed here
    none_hash: bytes | None = None  # the root of the core's block hash chain (prefix routing)
    cached_hashes: set[bytes] = field(default_factory=set)  # its prefix cache, from its KV events

    def score(self) -> tuple[int, float]:
        """(4 * queued + running, KV usage): lower is less loaded."""
        return _QUEUED_WEIGHT * self.num_queued + self.num_running, self.kv_cache_usage

    @property
    def num_queued(self) -> int:
        """Requests not started yet: waiting in the core, or sent since its latest stats."""
        return max(len(self.in_flight) - self.num_running, self.num_waiting, 0)


class _BlockView:
    """The fields of a request that the block hasher's extra keys read (mm features, cache salt)."""

    __slots__ = ("mm_features", "cache_salt", "lora_request")

    def __init__(self, request: EngineCoreRequest) -> None:
        self.mm_features = list(request.mm_features or [])
        self.cache_salt = request.cache_salt
        self.lora_request = request.lora_request


class DPRouter:
    """Routes requests to num_cores engine cores and tracks which core owns each request."""

    def __init__(self, num_cores: int, policy: str = "least_loaded", block_size: int = 16,
                 hash_algo: str = "sha256_cbor") -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy {policy!r} is unknown; allowed: {ROUTING_POLICIES}")
        self.policy = policy
        self.block_size = block_size
        self.hash_fn = get_hash_fn_by_name(hash_algo)
        self.cores = [CoreLoad() for _ in range(num_cores)]
        self.owners: dict[str, int] = {}
        self.lock = threading.Lock()

    # -- routing (frontend thread) ------------------------------------------------------------
    def assign(self, requests: Iterable[EngineCoreRequest]) -> dict[int, list[EngineCoreRequest]]:
        """Choose a core for each request (counting the earlier ones of the batch); grouped by core."""
        by_core: dict[int, list[EngineCoreRequest]] = {}
        with self.lock:
            for request in requests:
                index = self._choose(request)
                core = self.cores[index]
                core.in_flight.add(request.request_id)
                core.num_routed += 1
                self.owners[request.request_id] = index
                by_core.setdefault(index, []).append(request)
        return by_core

    def _choose(self, request: EngineCoreRequest) -> int:
        least = min(range(len(self.cores)), key=lambda i: (self.cores[i].score(), i))
        if self.policy != "prefix":
            return least
        matched = [self.matched_blocks(core, request) for core in self.cores]
        best = max(matched)
        if best == 0:
            return least
        index = min((i for i, m in enumerate(matched) if m == best), key=lambda i: (self.cores[i].score(), i))
        if self.cores[index].num_queued > 0 and self.cores[least].num_queued == 0:
            return least  # a queue costs more than the prefill the hit would save
        return index

    def matched_blocks(self, core: CoreLoad, request: EngineCoreRequest) -> int:
        """Leading full blocks of the prompt that the core holds in its prefix cache."""
        if core.none_hash is None or not core.cached_hashes:
            return 0
        tokens, size = request.prompt_token_ids, self.block_size
        view = _BlockView(request)
        parent, mm_idx, count = core.none_hash, 0, 0
        for start in range(0, len(tokens) - size + 1, size):
            extra_keys, mm_idx = generate_block_hash_extra_keys(view, start, start + size, mm_idx)  # type: ignore[arg-type]
            parent = hash_block_tokens(self.hash_fn, parent, tokens[start:start + size], extra_keys)
            if parent not in core.cached_hashes:
                break
            count += 1
        return count

    def release(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """Forget requests the frontend aborts; their ids grouped by owning core (unknown ids dropped)."""
        by_core: dict[int, list[str]] = {}
        with self.lock:
            for request_id in request_ids:
                index = self.owners.pop(request_id, None)
                if index is not None:
                    self.cores[index].in_flight.discard(request_id)
                    by_core.setdefault(index, []).append(request_id)
        return by_core

    def owner_of(self, request_id: str) -> int | None:
        with self.lock:
            return self.owners.get(request_id)

    # -- observation (each core's reader thread) ----------------------------------------------
    def set_none_hash(self, index: int, none_hash: bytes | None) -> None:
        with self.lock:
            self.cores[index].none_hash = none_hash

    def observe(self, index: int, outputs: EngineCoreOutputs) -> None:
        """Fold one message of core `index` in: finished requests, its gauges, its KV events."""
        core = self.cores[index]
        with self.lock:
            for output in outputs.outputs:
                if output.finish_reason is not None:
                    self._finish(core, output.request_id)
            for request_id in outputs.finished_requests or ():
                self._finish(core, request_id)
            stats = outputs.scheduler_stats
            if stats is not None:
                core.num_waiting, core.num_running = stats.num_waiting_reqs, stats.num_running_reqs
                core.kv_cache_usage = stats.kv_cache_usage
            if outputs.kv_events is not None and self.policy == "prefix":
                self._apply_events(core, outputs.kv_events)

    def _finish(self, core: CoreLoad, request_id: str) -> None:
        core.in_flight.discard(request_id)
        self.owners.pop(request_id, None)

    @staticmethod
    def _apply_events(core: CoreLoad, batch: KVEventBatch) -> None:
        for event in batch.events:
            if event.medium not in (None, MEDIUM_GPU):
                continue  # an offload tier's blocks: not this core's device cache
            if isinstance(event, BlockStored):
                core.cached_hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                core.cached_hashes.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                core.cached_hashes.clear()

    def snapshot(self) -> list[dict[str, Any]]:
        """Per-core routing state (for tests and the console)."""
        with self.lock:
            return [{"in_flight": len(c.in_flight), "num_routed": c.num_routed, "num_waiting": c.num_waiting,
                     "num_running": c.num_running, "kv_cache_usage": c.kv_cache_usage,
                     "num_cached_blocks": len(c.cached_hashes)} for c in self.cores]
