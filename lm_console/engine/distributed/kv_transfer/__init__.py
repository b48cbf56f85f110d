"""KV transfer: connectors that load and save decoder KV outside the paged cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lm_console._lazy import lazy_exports

if TYPE_CHECKING:
    from lm_console.engine.distributed.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
    from lm_console.engine.config.kv_transfer import KVTransferConfig
    from lm_console.engine.distributed.kv_transfer.factory import KVConnectorFactory
    from lm_console.engine.distributed.kv_transfer.output import KVConnectorOutput

__all__ = ["KVConnectorBase", "KVConnectorFactory", "KVConnectorMetadata", "KVConnectorOutput",
           "KVConnectorRole", "KVTransferConfig"]

__getattr__ = lazy_exports(__name__, {
    "KVConnectorBase": "lm_console.engine.distributed.kv_transfer.base",
    "KVConnectorMetadata": "lm_console.engine.distributed.kv_transfer.base",
    "KVConnectorRole": "lm_console.engine.distributed.kv_transfer.base",
    "KVTransferConfig": "lm_console.engine.config.kv_transfer",
    "KVConnectorFactory": "lm_console.engine.distributed.kv_transfer.factory",
    "KVConnectorOutput": "lm_console.engine.distributed.kv_transfer.output",
})
