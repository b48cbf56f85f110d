"""OffloadConnector: LMCache-style KV offload to a CPU RAM tier and a disk tier.

Prompts are cut into chunks (256 tokens by default) keyed by a hash chain; each chunk's KV is
stored once computed and, later, any stored prefix of chunks is loaded instead of recomputed,
even after the engine's own prefix cache evicted it, after a restart (disk), or when another
engine process on the machine computed it (shared disk tier).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm_console.engine.distributed.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from lm_console.engine.distributed.kv_transfer.offload.chunk_hash import ChunkHasher, model_fingerprint
from lm_console.engine.distributed.kv_transfer.offload.metadata import OffloadConnectorMetadata
from lm_console.engine.distributed.kv_transfer.offload.scheduler_side import OffloadScheduler
from lm_console.engine.distributed.kv_transfer.offload.settings import OffloadSettings
from lm_console.engine.distributed.kv_transfer.offload.store import TieredKVStore, get_shared_store, release_shared_store
from lm_console.engine.kv_cache_hashing import get_hash_fn_by_name
from lm_console.engine.metrics.stats import KVTierStats
from lm_console.engine.platform import torch_dtype

if TYPE_CHECKING:
    from lm_console.engine.config.engine_config import EngineConfig
    from lm_console.engine.kv_cache_interface import AllocatedBlocks
    from lm_console.engine.config.kv_transfer import KVTransferConfig
    from lm_console.engine.forward_context import ForwardContext
    from lm_console.engine.metrics.kv_events import KVCacheEvent
    from lm_console.engine.request import Request
    from lm_console.engine.scheduler_output import SchedulerOutput


class OffloadConnector(KVConnectorBase):
    """Both roles share one TieredKVStore per process (get_shared_store); the scheduler role plans,
    the worker role (OffloadWorker) moves bytes."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_transfer_config: KVTransferConfig) -> None:
        super().__init__(config, role, kv_transfer_config)
        self.settings = settings = OffloadSettings.from_config(config, kv_transfer_config)
        # One store per engine: both roles receive that engine's one KVTransferConfig object (the
        # core hands the scheduler role its config with num_blocks decided, a different object).
        self._store_key = (settings, kv_transfer_config.engine_id, id(kv_transfer_config))
        self.store: TieredKVStore = get_shared_store(self._store_key, lambda: TieredKVStore(
            settings.cpu_bytes, settings.disk_path, settings.disk_bytes, settings.chunk_shape,
            _chunk_dtype(settings.dtype_name), settings.chunk_size))
        self._closed = False
        self._scheduler: OffloadScheduler | None = None
        self._worker: Any = None
        if role == KVConnectorRole.SCHEDULER:
            fingerprint = model_fingerprint(Path(config.model_config.model_dir), settings.dtype_name,
                                            settings.chunk_shape)
            cache = config.cache_config
            hasher = ChunkHasher(settings.chunk_size, get_hash_fn_by_name(cache.prefix_caching_hash_algo), fingerprint)
            self._scheduler = OffloadScheduler(settings, self.store, hasher, cache.block_size,
                                               kv_transfer_config.is_kv_producer, kv_transfer_config.is_kv_consumer)
        else:
            from lm_console.engine.distributed.kv_transfer.offload.worker_side import OffloadWorker

            self._worker = OffloadWorker(settings, self.store)
        self._ran_forward = False

    # -- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def _metadata(self) -> OffloadConnectorMetadata | None:
        metadata = self._get_connector_metadata()
        return metadata if isinstance(metadata, OffloadConnectorMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext | None) -> None:
        self._ran_forward = forward_context is not None
        self._worker.start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for this step's layer-by-layer loads to have written layer_name ("layer.<i>")."""
        self._worker.wait_for_layer_load(int(layer_name.rpartition(".")[2]))

    def has_pending_layer_loads(self) -> bool:
        metadata = self._metadata()
        return metadata is not None and bool(metadata.layer_loads)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        """Chunks are copied out in wait_for_save, once every layer has written them."""

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._worker.get_finished(finished_req_ids, self._ran_forward)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> list[KVTierStats]:
        return self.store.make_stats()

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent] | None:
        return self.store.take_events() or None

    # -- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: AllocatedBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    # -- both -------------------------------------------------------------------------------
    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for queued disk writes (tests, benchmarks, the P/D demo)."""
        return self.store.flush(timeout_s)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._worker.shutdown()
        release_shared_store(self._store_key)


def _chunk_dtype(name: str) -> Any:
    """The torch dtype of the chunks: the KV cache's (int8 for the int8 cache, lm_console/engine/attention/int8_cache.py)."""
    import torch

    return torch.int8 if name == "int8" else torch_dtype(name)
