"""ECConnector: moving encoder outputs between engines or to storage."""

from lm_console.engine.distributed.ec_transfer.base import ECConnectorBase, ECConnectorMetadata, ECConnectorRole
from lm_console.engine.distributed.ec_transfer.config import ECTransferConfig
from lm_console.engine.distributed.ec_transfer.factory import ECConnectorFactory

__all__ = ["ECConnectorBase", "ECConnectorFactory", "ECConnectorMetadata", "ECConnectorRole", "ECTransferConfig"]
