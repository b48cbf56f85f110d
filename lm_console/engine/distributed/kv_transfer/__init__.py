"""KV transfer: connectors that load and save decoder KV outside the paged cache."""

from lm_console.engine.distributed.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from lm_console.engine.distributed.kv_transfer.config import KVTransferConfig
from lm_console.engine.distributed.kv_transfer.factory import KVConnectorFactory
from lm_console.engine.distributed.kv_transfer.output import KVConnectorOutput

__all__ = ["KVConnectorBase", "KVConnectorFactory", "KVConnectorMetadata", "KVConnectorOutput",
           "KVConnectorRole", "KVTransferConfig"]
