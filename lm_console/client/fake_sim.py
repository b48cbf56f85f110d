"""FakeEngineSim: a tiny, deterministic model of a paged-KV scheduler for the fake client.

It has the engine's moving parts in miniature (a block pool with ref counts, an LRU free queue
whose hashed blocks form the prefix cache, chunked prefill under a token budget, preemption by
recompute) and emits what the real engine emits: StatsSample, KVEventRecord and StreamChunk.
It generates words, not model output. Invariant: a block is in the free queue iff its ref count
is 0; a block with a hash in `cached` is evictable while free.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass, field

from lm_console.client.types import (
    BLOCK_CACHED, BLOCK_FREE, BLOCK_IN_USE, BLOCK_NULL, KVEventRecord, StatsSample, StreamChunk,
)

WORDS = ("the", "cache", "block", "token", "page", "batch", "prefix", "model", "step", "queue",
         "memory", "request", "attention", "stream", "engine", "decode", "prefill", "budget")


def word_of(token_id: int) -> str:
    """The fake vocabulary: every id is a word."""
    return WORDS[token_id % len(WORDS)]


def tokenize(text: str) -> list[int]:
    """Fake tokenizer: one stable id per word."""
    return [int.from_bytes(hashlib.sha256(w.encode()).digest()[:3], "big") for w in text.split()] or [1]


@dataclass(slots=True)
class SimRequest:
    """A request inside the simulator."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    arrival: float
    script: list[str] | None = None  # scripted reply words (chat); None: random words
    output_ids: list[int] = field(default_factory=list)
    output_words: list[str] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    last_block_hash: str = ""  # the hash chain's tip over num_hashed_blocks
    num_computed: int = 0
    num_cached: int = 0
    first_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class FakeEngineSim:
    """Continuous batching over a simulated block pool; `step(now)` is one engine step."""

    def __init__(self, num_blocks: int = 512, block_size: int = 16, token_budget: int = 256,
                 max_num_seqs: int = 16, seed: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.token_budget = token_budget
        self.max_num_seqs = max_num_seqs
        self.rng = random.Random(seed)
        self.ref_counts = [0] * num_blocks
        self.block_hash: dict[int, str] = {}
        self.cached: dict[str, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.num_steps = 0
        self._events: list[KVEventRecord] = []
        self._seq = 0

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request: SimRequest) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str, now: float) -> StreamChunk | None:
        """Remove a request; the chunk that ends its stream (None if it is unknown)."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self._free(request)
                    return self._chunk(request, "", 0, now, "abort")
        return None

    def reset_prefix_cache(self, now: float) -> bool:
        if any(self.ref_counts[b] for b in self.cached.values()):
            return False
        for block_id in list(self.cached.values()):
            del self.block_hash[block_id]
        self.cached.clear()
        self._emit(KVEventRecord(ts=now, kind="AllBlocksCleared"))
        return True

    # -- the step -------------------------------------------------------------------------
    def step(self, now: float) -> tuple[StatsSample, list[KVEventRecord], list[StreamChunk]]:
        """Schedule, 'run' and update one step."""
        budget = self.token_budget
        scheduled: list[tuple[SimRequest, int]] = []
        num_preempted = num_lookups = queries = hits = 0
        for request in list(self.running):
            if request not in self.running:
                continue  # preempted by a request ahead of it
            num_new = min(request.num_tokens - request.num_computed, budget)
            while not self._allocate(request, request.num_computed + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                num_preempted += 1
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
            if budget <= 0:
                break
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not num_preempted:
            request = self.waiting[0]
            if request.num_computed == 0:
                found = self._lookup(request)
                num_lookups += 1
                queries += request.num_tokens
                hits += found * self.block_size
            num_new = min(request.num_tokens - request.num_computed, budget)
            if not self._allocate(request, request.num_computed + num_new):
                break
            self.waiting.pop(0)
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        chunks: list[StreamChunk] = []
        num_prompt = num_gen = 0
        step_time = 0.012 + 0.0002 * (self.token_budget - budget)
        done = now + step_time  # outputs leave the step when its (simulated) compute ends
        for request, num_new in scheduled:
            request.num_computed += num_new
            self._cache_full_blocks(request, now)
            if request.num_computed < request.num_tokens:
                num_prompt += num_new
                continue
            num_prompt += num_new - 1
            num_gen += 1
            chunks.append(self._sample(request, done))
        self.num_steps += 1
        num_used = sum(1 for c in self.ref_counts[1:] if c)
        stats = StatsSample(
            ts=now, num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            num_preempted_reqs=num_preempted, num_scheduled_tokens=self.token_budget - budget,
            token_budget=self.token_budget, kv_cache_usage=num_used / (self.num_blocks - 1),
            num_free_blocks=len(self.free_queue), num_total_blocks=self.num_blocks - 1,
            prefix_requests=num_lookups, prefix_queries=queries, prefix_hits=hits,
            step_time_s=step_time, num_steps=self.num_steps,
            num_prompt_tokens=num_prompt, num_generation_tokens=num_gen,
            block_states=self.block_states(), block_ref_counts=bytes(min(c, 255) for c in self.ref_counts),
        )
        events, self._events = self._events, []
        for event in events:
            event.ts = now
        return stats, events, chunks

    def block_states(self) -> bytes:
        """One byte a block, as the engine's block_states."""
        states = bytearray(self.num_blocks)
        states[0] = BLOCK_NULL
        for block_id in range(1, self.num_blocks):
            if self.ref_counts[block_id]:
                states[block_id] = BLOCK_IN_USE
            elif block_id in self.block_hash:
                states[block_id] = BLOCK_CACHED
            else:
                states[block_id] = BLOCK_FREE
        return bytes(states)

    # -- internals ------------------------------------------------------------------------
    def _sample(self, request: SimRequest, now: float) -> StreamChunk:
        if request.script is not None:
            word = request.script[len(request.output_words)] if len(request.output_words) < len(request.script) else ""
        else:
            word = word_of(self.rng.randrange(1 << 16))
        request.output_words.append(word)
        request.output_ids.append(tokenize(word)[0])
        if request.first_token_time is None:
            request.first_token_time = now
        text = ("" if len(request.output_words) == 1 else " ") + word
        finish = None
        if request.script is not None and len(request.output_words) >= len(request.script):
            finish = "stop"
        elif len(request.output_ids) >= request.max_tokens:
            finish = "length"
        if finish:
            self.running.remove(request)
            self._free(request)
        return self._chunk(request, text, 1, now, finish)

    def _chunk(self, request: SimRequest, text: str, num_new: int, now: float,
               finish: str | None) -> StreamChunk:
        ttft = None if request.first_token_time is None else request.first_token_time - request.arrival
        tpot = None
        if finish and ttft is not None and len(request.output_ids) > 1:
            tpot = (now - request.first_token_time) / (len(request.output_ids) - 1)
        return StreamChunk(
            request_id=request.request_id, text=text, num_new_tokens=num_new,
            num_prompt_tokens=len(request.prompt_ids), num_cached_tokens=request.num_cached,
            finished=finish is not None, finish_reason=finish, ttft_s=ttft, tpot_s=tpot,
            e2e_s=(now - request.arrival) if finish else None,
        )

    def _lookup(self, request: SimRequest) -> int:
        """Touch the longest cached prefix of full blocks (never the last token); its length."""
        ids = request.all_ids()
        parent = ""
        found = 0
        for start in range(0, request.num_tokens - 1 - self.block_size + 1, self.block_size):
            block_hash = _hash(parent, ids[start:start + self.block_size])
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            self._touch(block_id)
            request.block_ids.append(block_id)
            parent = block_hash
            found += 1
        request.num_computed = request.num_cached = found * self.block_size
        request.num_hashed_blocks = found
        request.last_block_hash = parent
        return found

    def _allocate(self, request: SimRequest, num_tokens: int) -> bool:
        needed = -(-num_tokens // self.block_size) - len(request.block_ids)
        if needed > len(self.free_queue):
            return False
        for _ in range(max(needed, 0)):
            block_id, _ = self.free_queue.popitem(last=False)
            old_hash = self.block_hash.pop(block_id, None)
            if old_hash is not None:
                del self.cached[old_hash]
                self._emit(KVEventRecord(ts=0.0, kind="BlockRemoved", block_hashes=[old_hash]))  # ts set by step()
            self.ref_counts[block_id] = 1
            request.block_ids.append(block_id)
        return True

    def _touch(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free_queue[block_id]
        self.ref_counts[block_id] += 1

    def _free(self, request: SimRequest) -> None:
        for block_id in reversed(request.block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None
        request.block_ids = []
        request.num_hashed_blocks = 0
        request.last_block_hash = ""

    def _preempt(self, request: SimRequest) -> None:
        self._free(request)
        request.num_computed = 0
        self.waiting.insert(0, request)

    def _cache_full_blocks(self, request: SimRequest, now: float) -> None:
        num_full = min(request.num_computed // self.block_size, len(request.block_ids))
        if num_full <= request.num_hashed_blocks:
            return
        ids = request.all_ids()
        start = request.num_hashed_blocks
        parent = request.last_block_hash
        first_parent = parent or None
        new_hashes: list[str] = []
        for index in range(start, num_full):
            block_hash = _hash(parent, ids[index * self.block_size:(index + 1) * self.block_size])
            block_id = request.block_ids[index]
            if block_hash not in self.cached and block_id not in self.block_hash:
                self.cached[block_hash] = block_id
                self.block_hash[block_id] = block_hash
                new_hashes.append(block_hash)
            parent = block_hash
        request.num_hashed_blocks = num_full
        request.last_block_hash = parent
        if new_hashes:
            self._emit(KVEventRecord(
                ts=now, kind="BlockStored", block_hashes=new_hashes, parent_block_hash=first_parent,
                num_tokens=len(new_hashes) * self.block_size, block_size=self.block_size))

    def _emit(self, event: KVEventRecord) -> None:
        self._seq += 1
        event.seq = self._seq
        self._events.append(event)


def _hash(parent: str, token_ids: list[int]) -> str:
    return hashlib.sha256(f"{parent}|{token_ids}".encode()).hexdigest()[:16]
