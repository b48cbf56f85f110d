"""Data parallelism: data_parallel_size engine cores behind one frontend client (vLLM: DPLBAsyncMPClient).

Each core is a full EngineCore in its own process (lm_console/engine/frontend/engine_process.py; with
data_parallel_backend="ray" a Ray actor, lm_console/engine/frontend/dp_ray.py), with its
own executor and KV cache and its data_parallel_rank in its config; it tags its outputs,
SchedulerStats and KV event batches with that rank. One MPClient per core reads that core's
outputs into a _CoreSink, which resolves the core's own utility calls, lets the DPRouter
(lm_console/engine/frontend/dp_router.py) see its stats, finished requests and KV events, and hands the
rest on to the one shared sink that LLM / AsyncLLM consume, exactly as with a single core.

Requests go to the core the router picks; aborts go to the core that owns the request.
Utility calls go to every core: get_stats, get_block_pool_state and get_request_blocks return the cores' merged
view, and the *_per_core methods each core's own. When any core dies, every pending and later
call fails with EngineDeadError at once and the other cores are stopped in the background, so
the engine leaves no process behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import weakref
from collections.abc import Callable
from typing import Any

from lm_console.engine.config.engine_args import EngineArgs
from lm_console.engine.core.request_blocks import merge_request_blocks
from lm_console.engine.errors import EngineDeadError, fresh_error
from lm_console.engine.frontend.core_client import EngineCoreClient
from lm_console.engine.frontend.dp_router import DPRouter
from lm_console.engine.frontend.engine_process import EngineProcess
from lm_console.engine.frontend.mp_client import (
    AsyncMPClient, MPClient, OutputSink, SinkStateMixin, SyncMPClient, _AsyncSink, _SyncSink,
)
from lm_console.engine.metrics.stats import (
    PER_STEP_FIELDS,
    BlockPoolState,
    PrefixCacheStatsSnapshot,
    SchedulerStats,
    SpecDecodingStats,
)
from lm_console.engine.platform import usable_cpus
from lm_console.engine.protocol import EngineCoreOutputs, EngineCoreRequest


def core_engine_args(engine_args: EngineArgs, rank: int) -> EngineArgs:
    """The EngineArgs of core `rank`: its data_parallel_rank, KV events on for prefix routing,
    and on CPU its share of the machine's cores when num_threads is unset."""
    changes: dict[str, Any] = {"data_parallel_rank": rank}
    if engine_args.data_parallel_routing == "prefix":
        changes["enable_kv_cache_events"] = True
    if engine_args.num_threads is None and engine_args.device != "cuda":
        # N cores each using every CPU thread would fight over them; on CUDA torch threads matter little.
        changes["num_threads"] = max(usable_cpus() // engine_args.data_parallel_size, 1)
    return dataclasses.replace(engine_args, **changes)


class _CoreGroup:
    """The cores' shared fate: one stops, all stop. Holds no reference to the client (finalizer)."""

    def __init__(self, shared: OutputSink, router: DPRouter) -> None:
        self.shared = shared
        self.router = router
        self.sinks: list[_CoreSink] = []
        self.resources: list[Any] = []  # each core's EngineProcess
        self.after_close: Callable[[], None] | None = None  # the Ray backend's placement group and actors
        self.lock = threading.Lock()
        self.close_lock = threading.Lock()
        self.stopping = False
        self.closer: threading.Thread | None = None

    def core_stopped(self, sink: _CoreSink, error: BaseException, unexpected: bool) -> None:
        """A core died (unexpected) or was shut down: every caller learns it now."""
        with self.lock:
            if self.stopping:
                return
            self.stopping = True
        if unexpected:  # same type (EngineUnresponsiveError stays one), naming the core
            error_type = type(error) if isinstance(error, EngineDeadError) else EngineDeadError
            error = error_type(f"Data-parallel engine core {sink.rank}: {error}")
        self.shared.on_dead(error, unexpected)  # type: ignore[arg-type]
        for other in self.sinks:
            if other is not sink:
                other.on_dead(fresh_error(error), unexpected)  # type: ignore[arg-type]
        if unexpected:  # stop the survivors; shutdown() waits for this
            self.closer = threading.Thread(target=self.close_all, name="DPCoreCloser", daemon=True)
            self.closer.start()

    def close_all(self) -> None:
        """Stop every core (SHUTDOWN, then SIGTERM, then SIGKILL) and release its sockets."""
        with self.close_lock:
            for sink, resources in zip(self.sinks, self.resources):
                resources.close(sink)
            if self.after_close is not None:
                self.after_close()
        closer = self.closer
        if closer is not None and closer is not threading.current_thread():
            closer.join()


class _CoreSink(OutputSink):
    """One core's sink: its own utility calls; everything else goes on to the shared sink."""

    def __init__(self, rank: int, group: _CoreGroup) -> None:
        super().__init__()
        self.rank = rank
        self.group = group

    def deliver(self, item: EngineCoreOutputs | BaseException) -> None:
        if isinstance(item, BaseException):
            self.group.core_stopped(self, item, self.errored)
            return
        self.group.router.observe(self.rank, item)
        self.group.shared.deliver(item)


class DPClient(SinkStateMixin, EngineCoreClient):
    """data_parallel_size engine-core processes behind one client; see the module docstring."""

    def __init__(self, engine_args: EngineArgs, shared: OutputSink,
                 while_starting: Callable[[], None] | None = None) -> None:
        engine_args._verify()
        self.engine_args = engine_args
        self.sink = shared
        num_cores = engine_args.data_parallel_size
        self.router = DPRouter(num_cores, engine_args.data_parallel_routing, engine_args.block_size,
                               engine_args.prefix_caching_hash_algo)
        self.group = _CoreGroup(shared, self.router)
        self.cores: list[MPClient] = []
        self._finalizer = weakref.finalize(self, self.group.close_all)
        # All cores start side by side (each loads its model while the others do), then each
        # handshake is awaited in rank order.
        launched: list[EngineProcess] = []
        try:
            if engine_args.data_parallel_backend == "ray":  # Ray actors (lm_console/engine/frontend/dp_ray.py)
                from lm_console.engine.frontend.dp_ray import RayCores

                ray_cores = RayCores(engine_args, [core_engine_args(engine_args, r) for r in range(num_cores)])
                self.group.after_close = ray_cores.close
                launched.extend(ray_cores.processes)
            for rank in range(len(launched), num_cores):
                launched.append(EngineProcess(core_engine_args(engine_args, rank)))
                launched[-1].launch()
            if while_starting is not None:
                while_starting()
            for rank, resources in enumerate(launched):
                sink = _CoreSink(rank, self.group)
                core = MPClient(resources.engine_args, sink, launched=resources)
                core._finalizer.detach()  # the group closes every core, in order
                self.group.sinks.append(sink)
                self.group.resources.append(resources)
                self.cores.append(core)
                self.router.set_none_hash(rank, core.ready_info.none_hash)
        except BaseException:
            for resources in launched:  # a core that failed closed itself; close() is idempotent
                resources.close()
            if self.group.after_close is not None:
                self.group.after_close()
            raise
        self._latest_stats: dict[int, SchedulerStats] = {}
        self.ready_info = self.cores[0].ready_info
        self.ready_infos = [core.ready_info for core in self.cores]

    # -- inputs -----------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Route each request; one message per core."""
        self._check_alive()
        for rank, core_requests in self.router.assign(requests).items():
            self.cores[rank].add_requests(core_requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort on the owning cores; ids of finished or unknown requests need nothing."""
        if not request_ids:
            return
        self._check_alive()
        for rank, core_ids in self.router.release(request_ids).items():
            self.cores[rank].abort_requests(core_ids)

    # -- utility calls ----------------------------------------------------------------------
    def call_utility_futures(self, method: str, *args: Any) -> list[Any]:
        """The same utility call on every core; one future per core, in rank order."""
        self._check_alive()
        return [core.call_utility_future(method, *args) for core in self.cores]

    def call_utility_per_core(self, method: str, *args: Any) -> list[Any]:
        return [future.result() for future in self.call_utility_futures(method, *args)]

    def call_utility(self, method: str, *args: Any) -> Any:
        return merge_results(method, self.call_utility_per_core(method, *args))

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        futures = self.call_utility_futures(method, *args)
        results = await asyncio.gather(*(asyncio.wrap_future(future) for future in futures))
        return merge_results(method, list(results))

    def engine_wide_stats(self, stats: SchedulerStats) -> SchedulerStats:
        """One core's step stats as the whole engine's, for stat loggers (gauges and totals over
        every core's latest; this step's own counters as they are)."""
        self._latest_stats[stats.engine_index] = stats
        merged = merge_stats(list(self._latest_stats.values()))
        for name in PER_STEP_FIELDS:
            setattr(merged, name, getattr(stats, name))
        return merged

    def get_stats_per_core(self) -> list[SchedulerStats]:
        return self.call_utility_per_core("get_stats")

    def get_block_pool_state_per_core(self) -> list[BlockPoolState]:
        return self.call_utility_per_core("get_block_pool_state")

    # -- state ------------------------------------------------------------------------------
    @property
    def num_cores(self) -> int:
        return len(self.cores)

    @property
    def core_pids(self) -> list[int]:
        return [core.proc.pid for core in self.cores]


class SyncDPClient(DPClient):
    """The data-parallel client of the synchronous LLM."""

    def __init__(self, engine_args: EngineArgs, while_starting: Callable[[], None] | None = None) -> None:
        super().__init__(engine_args, _SyncSink(), while_starting)

    get_output = SyncMPClient.get_output


class AsyncDPClient(DPClient):
    """The data-parallel client of AsyncLLM."""

    def __init__(self, engine_args: EngineArgs, while_starting: Callable[[], None] | None = None) -> None:
        super().__init__(engine_args, _AsyncSink(), while_starting)

    get_output_async = AsyncMPClient.get_output_async

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError("AsyncDPClient: use get_output_async()")


# -- merging the cores' answers ---------------------------------------------------------------
def merge_results(method: str, results: list[Any]) -> Any:
    """One answer from every core's: merged stats, block pools and request blocks, all() of booleans, lists joined
    (anything else: the list of the cores' answers, in rank order)."""
    if method == "get_stats":
        return merge_stats(results)
    if method == "get_block_pool_state":
        return merge_block_pool_states(results)
    if method == "get_request_blocks":
        return merge_request_blocks(results)
    if all(isinstance(result, bool) for result in results):
        return all(results)
    if all(isinstance(result, list) for result in results):  # e.g. prefix-cache hashes: every core's
        return [item for result in results for item in result]
    return results


def merge_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The cores' SchedulerStats as one engine's: counts summed, KV usage over all blocks."""
    total_blocks = sum(s.num_total_blocks for s in stats)
    used = sum(s.kv_cache_usage * s.num_total_blocks for s in stats)
    states = [s.block_states for s in stats]
    ref_counts = [s.block_ref_counts for s in stats]
    return SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in stats),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
        num_preempted_reqs=sum(s.num_preempted_reqs for s in stats),
        num_scheduled_tokens=sum(s.num_scheduled_tokens for s in stats),
        token_budget=sum(s.token_budget for s in stats),
        kv_cache_usage=used / total_blocks if total_blocks else 0.0,
        num_free_blocks=sum(s.num_free_blocks for s in stats),
        num_total_blocks=total_blocks,
        prefix_cache=PrefixCacheStatsSnapshot(
            requests=sum(s.prefix_cache.requests for s in stats), queries=sum(s.prefix_cache.queries for s in stats),
            hits=sum(s.prefix_cache.hits for s in stats)),
        step_time_s=max((s.step_time_s for s in stats), default=0.0),
        num_steps=sum(s.num_steps for s in stats),
        num_prompt_tokens=sum(s.num_prompt_tokens for s in stats),
        num_generation_tokens=sum(s.num_generation_tokens for s in stats),
        num_preemptions_total=sum(s.num_preemptions_total for s in stats),
        timestamp=max((s.timestamp for s in stats), default=0.0),
        block_states=b"".join(states) if all(x is not None for x in states) else None,  # type: ignore[arg-type]
        block_ref_counts=b"".join(ref_counts) if all(x is not None for x in ref_counts) else None,  # type: ignore[arg-type]
        spec_decoding=_merge_spec_decoding([s.spec_decoding for s in stats if s.spec_decoding is not None]),
    )


def _merge_spec_decoding(parts: list[SpecDecodingStats]) -> SpecDecodingStats | None:
    """The cores' cumulative speculative-decoding counters, summed (None: no core speculates)."""
    if not parts:
        return None
    merged = SpecDecodingStats.new(max(p.num_spec_tokens for p in parts))
    for part in parts:
        merged.num_drafts += part.num_drafts
        merged.num_draft_tokens += part.num_draft_tokens
        merged.num_accepted_tokens += part.num_accepted_tokens
        for position, count in enumerate(part.num_accepted_tokens_per_pos):
            merged.num_accepted_tokens_per_pos[position] += count
    return merged


def merge_block_pool_states(states: list[BlockPoolState]) -> BlockPoolState:
    """The cores' pools as one (one null block counted): all_free holds iff it holds on every core."""
    return BlockPoolState(
        num_blocks=sum(s.num_total_blocks for s in states) + 1,
        num_free_blocks=sum(s.num_free_blocks for s in states),
        num_cached_blocks=sum(s.num_cached_blocks for s in states),
        num_running_reqs=sum(s.num_running_reqs for s in states),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in states),
        block_states=b"".join(s.block_states for s in states),
        block_ref_counts=b"".join(s.block_ref_counts for s in states),
    )


__all__ = ["AsyncDPClient", "DPClient", "SyncDPClient", "core_engine_args", "merge_stats"]
