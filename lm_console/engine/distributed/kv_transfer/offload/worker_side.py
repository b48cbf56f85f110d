"""The OffloadConnector's worker role: chunk loads on a background thread, chunk saves after the forward."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from lm_console.engine.distributed.kv_transfer.offload.chunk_codec import CorruptChunkError
from lm_console.engine.distributed.kv_transfer.offload.kv_layout import gather_chunk, scatter_chunk, scatter_chunk_layer
from lm_console.engine.distributed.kv_transfer.offload.metadata import ChunkLoad, OffloadConnectorMetadata
from lm_console.engine.distributed.kv_transfer.offload.settings import OffloadSettings
from lm_console.engine.distributed.kv_transfer.offload.store import TieredKVStore

logger = logging.getLogger(__name__)

_STOP = object()
# With loads in flight and nothing else to do, get_finished waits this long for one to end
# instead of letting the engine loop spin.
_IDLE_WAIT_S = 0.005


@dataclass(eq=False)
class _LoadJob:
    req_id: str
    chunks: list[ChunkLoad]
    started: float = field(default_factory=time.monotonic)
    num_done: int = 0  # chunks written into their blocks
    failed: bool = False
    cancelled: bool = False
    finished: bool = False


@dataclass(eq=False)
class _LayerLoad:
    """This step's layer-by-layer loads: layer_ready[i] is set once layer i's chunks are written."""

    chunks: list[tuple[ChunkLoad, torch.Tensor | None]]
    layer_ready: list[threading.Event]
    cancelled: bool = False
    thread: threading.Thread | None = None  # None: inline, each layer copied when it is waited for
    next_layer: int = 0  # inline mode: the first layer not copied yet


class OffloadWorker:
    """Worker-side state. Invariant: after cancel() returns, the job writes no block again
    (every write happens under _write_lock after checking `cancelled`), so the scheduler may
    hand its blocks to another request."""

    def __init__(self, settings: OffloadSettings, store: TieredKVStore) -> None:
        self.settings = settings
        self.store = store
        self.kv_caches: list[torch.Tensor] = []
        self._jobs: dict[str, _LoadJob] = {}
        self._queue: queue.Queue[object] = queue.Queue()
        self._write_lock = threading.Lock()
        self._job_done = threading.Condition()
        self._invalid_block_ids: set[int] = set()
        self._thread: threading.Thread | None = None
        self._layer_load: _LayerLoad | None = None
        self.layer_copy_thread = False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = list(kv_caches.values())
        # On the CPU the copy and the model share the same cores (a second thread's parallel
        # regions oversubscribe them): copy each layer inline, just before it runs. On a GPU a
        # loader thread copies ahead while earlier layers compute.
        self.layer_copy_thread = bool(self.kv_caches) and self.kv_caches[0].device.type != "cpu"

    # -- loads -----------------------------------------------------------------------------
    def start_load_kv(self, metadata: OffloadConnectorMetadata | None) -> None:
        if metadata is None:
            return
        if metadata.layer_loads:
            self._start_layer_load(metadata)
        if not metadata.loads:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._load_loop, name="kv-offload-loader", daemon=True)
            self._thread.start()
        for req_id, chunks in metadata.loads.items():
            job = _LoadJob(req_id, chunks)
            self._jobs[req_id] = job
            self._queue.put(job)

    def _load_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            assert isinstance(job, _LoadJob)
            try:
                self._run_job(job)
            except Exception:  # noqa: BLE001 - a failed load is recomputed, never fatal
                logger.exception("KV offload: load of request %s failed", job.req_id)
                job.failed = True
            finally:
                for chunk in job.chunks[job.num_done:]:
                    if chunk.pinned:
                        self.store.unpin(chunk.key)
                with self._job_done:
                    job.finished = True
                    self._job_done.notify_all()

    def _run_job(self, job: _LoadJob) -> None:
        for chunk in job.chunks:
            if job.cancelled:
                return
            try:
                tensor = self.store.get(chunk.key)
            except CorruptChunkError as exc:
                logger.warning("KV offload: chunk %s is corrupt (%s); its tokens will be recomputed",
                               chunk.key.hex()[:16], exc)
                self.store.discard(chunk.key)
                tensor = None
            if tensor is None:
                job.failed = True
                return
            with self._write_lock:
                if job.cancelled:
                    return
                scatter_chunk(self.kv_caches, tensor, chunk.token_offset, chunk.block_ids)
                job.num_done += 1
            if chunk.pinned:
                self.store.unpin(chunk.key)

    # -- layer-by-layer loads (during the forward) ----------------------------------------------
    def _start_layer_load(self, metadata: OffloadConnectorMetadata) -> None:
        chunks: list[tuple[ChunkLoad, torch.Tensor | None]] = []
        for loads in metadata.layer_loads.values():
            failed = False
            for chunk in loads:
                # Pinned in the CPU tier: a dict lookup. Never the disk here: this is the step's
                # critical path (a chunk evicted before its pin is recomputed instead).
                tensor = None if failed else self.store.get_cached(chunk.key)
                failed = failed or tensor is None
                if failed:  # this chunk and the request's later ones are recomputed
                    self._invalid_block_ids.update(chunk.block_ids)
                chunks.append((chunk, tensor))
        layer_load = _LayerLoad(chunks, [threading.Event() for _ in self.kv_caches])
        self._layer_load = layer_load
        if not self.layer_copy_thread:
            return
        layer_load.thread = threading.Thread(target=self._layer_load_loop, args=(layer_load,),
                                             name="kv-offload-layer-loader", daemon=True)
        layer_load.thread.start()

    def _copy_layers_inline(self, layer_load: _LayerLoad, up_to: int) -> None:
        while layer_load.next_layer <= up_to:
            layer = layer_load.next_layer
            for chunk, tensor in layer_load.chunks:
                if tensor is not None:
                    scatter_chunk_layer(self.kv_caches[layer], tensor[layer], chunk.token_offset, chunk.block_ids)
            layer_load.next_layer += 1

    def _layer_load_loop(self, layer_load: _LayerLoad) -> None:
        try:
            for layer, kv_cache in enumerate(self.kv_caches):
                with self._write_lock:
                    if layer_load.cancelled:
                        return
                    for chunk, tensor in layer_load.chunks:
                        if tensor is not None:
                            scatter_chunk_layer(kv_cache, tensor[layer], chunk.token_offset, chunk.block_ids)
                layer_load.layer_ready[layer].set()
        except Exception:  # noqa: BLE001 - recomputed, never fatal
            logger.exception("KV offload: layer-by-layer load failed")
            for chunk, _ in layer_load.chunks:
                self._invalid_block_ids.update(chunk.block_ids)
        finally:
            for event in layer_load.layer_ready:
                event.set()  # nobody waits forever; failures are in _invalid_block_ids

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Block until this step's loads wrote layer_index (the attention layer reads it next)."""
        layer_load = self._layer_load
        if layer_load is None or layer_index >= len(layer_load.layer_ready):
            return
        if layer_load.thread is None:
            self._copy_layers_inline(layer_load, layer_index)
            return
        if not layer_load.layer_ready[layer_index].wait(self.settings.load_timeout_s):
            self._finish_layer_load(timed_out=True)

    def _finish_layer_load(self, timed_out: bool = False) -> None:
        """End this step's layer loads: wait (bounded) for the loader, else cancel; unpin chunks."""
        layer_load, self._layer_load = self._layer_load, None
        if layer_load is None:
            return
        if layer_load.thread is None:  # inline: copy what no hook asked for (the blocks must hold it)
            self._copy_layers_inline(layer_load, len(self.kv_caches) - 1)
        elif not timed_out:
            layer_load.thread.join(self.settings.load_timeout_s)
        if timed_out or (layer_load.thread is not None and layer_load.thread.is_alive()):
            logger.warning("KV offload: layer-by-layer load timed out; its requests are recomputed")
            with self._write_lock:
                layer_load.cancelled = True
            for chunk, _ in layer_load.chunks:
                self._invalid_block_ids.update(chunk.block_ids)
        for chunk, _ in layer_load.chunks:
            if chunk.pinned:
                self.store.unpin(chunk.key)

    def _cancel(self, job: _LoadJob) -> None:
        with self._write_lock:
            job.cancelled = True

    def get_finished(self, finished_req_ids: set[str], ran_forward: bool) -> set[str] | None:
        """Requests whose load ended (done, failed, cancelled or timed out); bad blocks go to invalid ids."""
        if not self._jobs:
            if not ran_forward:  # an idle step (e.g. waiting for a producer's chunks): do not spin
                time.sleep(_IDLE_WAIT_S)
            return None
        now = time.monotonic()
        for req_id, job in self._jobs.items():
            if req_id in finished_req_ids or (not job.finished and now - job.started > self.settings.load_timeout_s):
                if not job.finished and req_id not in finished_req_ids:
                    logger.warning("KV offload: load of request %s timed out after %.1f s; recomputing",
                                   req_id, self.settings.load_timeout_s)
                self._cancel(job)
        if not ran_forward and not any(job.finished or job.cancelled for job in self._jobs.values()):
            with self._job_done:
                self._job_done.wait(_IDLE_WAIT_S)
        done: set[str] = set()
        for req_id, job in list(self._jobs.items()):
            if not (job.finished or job.cancelled):
                continue
            with self._write_lock:  # num_done is final once cancelled or finished
                for chunk in job.chunks[job.num_done:]:
                    self._invalid_block_ids.update(chunk.block_ids)
            del self._jobs[req_id]
            done.add(req_id)
        return done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    # -- saves -----------------------------------------------------------------------------
    def wait_for_save(self, metadata: OffloadConnectorMetadata | None) -> None:
        """Copy this step's finished chunks out of the paged cache (the blocks may be reused next
        step); the store writes them to disk in the background."""
        self._finish_layer_load()  # every layer has been read by now (or the step had no hooks)
        if metadata is None:
            return
        for save in metadata.saves:
            tensor = gather_chunk(self.kv_caches, save.block_ids, self.settings.chunk_size)
            self.store.put(save.key, tensor, save.parent, save.token_ids)

    def shutdown(self) -> None:
        self._finish_layer_load()
        for job in self._jobs.values():
            self._cancel(job)
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(5.0)
            self._thread = None
