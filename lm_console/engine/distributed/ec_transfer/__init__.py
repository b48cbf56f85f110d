"""ECConnector: moving encoder outputs between engines or to storage."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lm_console._lazy import lazy_exports

if TYPE_CHECKING:
    from lm_console.engine.distributed.ec_transfer.base import ECConnectorBase, ECConnectorMetadata, ECConnectorRole
    from lm_console.engine.config.ec_transfer import ECTransferConfig
    from lm_console.engine.distributed.ec_transfer.factory import ECConnectorFactory

__all__ = ["ECConnectorBase", "ECConnectorFactory", "ECConnectorMetadata", "ECConnectorRole", "ECTransferConfig"]

__getattr__ = lazy_exports(__name__, {
    "ECConnectorBase": "lm_console.engine.distributed.ec_transfer.base",
    "ECConnectorMetadata": "lm_console.engine.distributed.ec_transfer.base",
    "ECConnectorRole": "lm_console.engine.distributed.ec_transfer.base",
    "ECTransferConfig": "lm_console.engine.config.ec_transfer",
    "ECConnectorFactory": "lm_console.engine.distributed.ec_transfer.factory",
})
