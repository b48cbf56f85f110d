"""OffloadSettings: the OffloadConnector's kv_connector_extra_config, validated at start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lm_console.engine.errors import InvalidEngineArgsError

if TYPE_CHECKING:
    from lm_console.engine.config.engine_config import EngineConfig
    from lm_console.engine.config.kv_transfer import KVTransferConfig

_KEYS = {"cpu_bytes", "disk_path", "disk_bytes", "chunk_size", "save_decode", "load_timeout_s",
         "remote_wait_s", "load_mode"}
LOAD_MODES = ("async", "layerwise")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


@dataclass(frozen=True)
class OffloadSettings:
    """Tier sizes and chunking; chunk_nbytes is the size of one chunk across all layers."""

    chunk_size: int
    cpu_bytes: int
    disk_path: str | None
    disk_bytes: int
    save_decode: bool  # also store chunks filled by generated tokens
    load_timeout_s: float  # a load running longer is cancelled and its tokens recomputed
    remote_wait_s: float  # P/D consumer: how long to wait for the producer's chunks
    # async: every hit loads off the forward pass (the request waits in WAITING_FOR_REMOTE_KVS).
    # layerwise: CPU-tier hits load during the forward, layer by layer (loading layer i+1
    # overlaps computing layer i); disk hits still load asynchronously.
    load_mode: str
    num_layers: int
    num_kv_heads: int
    head_dim: int  # the cache rows' last dimension (the int8 cache's rows end in their scale)
    dtype_name: str  # the KV cache's element type: the model's, or "int8"

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.chunk_size, self.num_kv_heads, self.head_dim)

    @property
    def chunk_nbytes(self) -> int:
        layers, two, size, heads, dim = self.chunk_shape
        return layers * two * size * heads * dim * _DTYPE_BYTES.get(self.dtype_name, 4)

    @classmethod
    def from_config(cls, config: EngineConfig, kv_transfer_config: KVTransferConfig) -> OffloadSettings:
        """Read and check the extra config; InvalidEngineArgsError names what is wrong."""
        extra: dict[str, Any] = kv_transfer_config.kv_connector_extra_config
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise InvalidEngineArgsError(
                f"OffloadConnector: unknown kv_connector_extra_config key(s) {unknown}; allowed: {sorted(_KEYS)}.")
        model = config.model_config
        # Chunks hold the cache's own bytes: the int8 cache's rows (values and scale) as they are.
        from lm_console.kernels.cpu_attention import INT8_SCALE_BYTES

        int8 = config.cache_config.kv_cache_dtype == "int8"
        settings = cls(
            chunk_size=_int(extra, "chunk_size", 256),
            cpu_bytes=_int(extra, "cpu_bytes", 1 << 30),
            disk_path=str(extra["disk_path"]) if extra.get("disk_path") else None,
            disk_bytes=_int(extra, "disk_bytes", 16 << 30),
            save_decode=bool(extra.get("save_decode", False)),
            load_timeout_s=float(extra.get("load_timeout_s", 30.0)),
            remote_wait_s=float(extra.get("remote_wait_s", 10.0)),
            load_mode=str(extra.get("load_mode", "async")),
            num_layers=model.num_layers, num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim + (INT8_SCALE_BYTES if int8 else 0), dtype_name="int8" if int8 else model.dtype,
        )
        block_size = config.cache_config.block_size
        if settings.chunk_size % block_size:
            raise InvalidEngineArgsError(
                f"OffloadConnector: chunk_size={settings.chunk_size} must be a multiple of "
                f"block_size={block_size}.")
        if settings.cpu_bytes < settings.chunk_nbytes:
            raise InvalidEngineArgsError(
                f"OffloadConnector: cpu_bytes={settings.cpu_bytes} is smaller than one chunk "
                f"({settings.chunk_nbytes} bytes for {settings.chunk_size} tokens); raise cpu_bytes or lower chunk_size.")
        if settings.disk_path is not None and settings.disk_bytes < settings.chunk_nbytes + 4096:
            raise InvalidEngineArgsError(
                f"OffloadConnector: disk_bytes={settings.disk_bytes} is smaller than one chunk file "
                f"({settings.chunk_nbytes} bytes plus a header); raise disk_bytes or lower chunk_size.")
        if settings.load_mode not in LOAD_MODES:
            raise InvalidEngineArgsError(
                f"OffloadConnector: load_mode={settings.load_mode!r} is invalid; allowed: {', '.join(LOAD_MODES)}.")
        if settings.load_timeout_s <= 0 or settings.remote_wait_s < 0:
            raise InvalidEngineArgsError("OffloadConnector: load_timeout_s must be > 0 and remote_wait_s >= 0.")
        return settings


def _int(extra: dict[str, Any], key: str, default: int) -> int:
    value = extra.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidEngineArgsError(f"OffloadConnector: {key}={value!r} must be an integer >= 1.")
    return value
