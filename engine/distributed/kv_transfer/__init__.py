"""KV transfer: connectors that load and save decoder KV outside the paged cache (seed: lines 3252-3549)."""

from engine.distributed.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from engine.distributed.kv_transfer.config import KVTransferConfig
from engine.distributed.kv_transfer.factory import KVConnectorFactory
from engine.distributed.kv_transfer.output import KVConnectorOutput

__all__ = ["KVConnectorBase", "KVConnectorFactory", "KVConnectorMetadata", "KVConnectorOutput",
           "KVConnectorRole", "KVTransferConfig"]
