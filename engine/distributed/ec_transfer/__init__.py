"""ECConnector: moving encoder outputs between engines or to storage (seed: lines 673-959)."""

from engine.distributed.ec_transfer.base import ECConnectorBase, ECConnectorMetadata, ECConnectorRole
from engine.distributed.ec_transfer.config import ECTransferConfig
from engine.distributed.ec_transfer.factory import ECConnectorFactory

__all__ = ["ECConnectorBase", "ECConnectorFactory", "ECConnectorMetadata", "ECConnectorRole", "ECTransferConfig"]
