"""ECConnectorFactory: connectors by name, lazily imported, or from any module."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from lm_console.engine.errors import InvalidEngineArgsError

if TYPE_CHECKING:
    from lm_console.engine.distributed.ec_transfer.base import ECConnectorBase, ECConnectorRole
    from lm_console.engine.config.ec_transfer import ECTransferConfig


class ECConnectorFactory:
    """Registry of name -> loader; ec_connector_module_path loads any class dynamically."""

    _registry: dict[str, Callable[[], type[ECConnectorBase]]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Register a connector whose module is imported only when it is created."""
        if name in cls._registry:
            raise ValueError(f"ECConnector {name!r} is already registered")

        def loader() -> type[ECConnectorBase]:
            return getattr(importlib.import_module(module_path), class_name)

        cls._registry[name] = loader

    @classmethod
    def get_connector_class(cls, config: ECTransferConfig) -> type[ECConnectorBase]:
        from lm_console.engine.distributed.ec_transfer.base import ECConnectorBase

        name = config.ec_connector
        if config.ec_connector_module_path:
            try:
                module = importlib.import_module(config.ec_connector_module_path)
                connector_cls = getattr(module, name)
            except (ImportError, AttributeError) as error:
                raise InvalidEngineArgsError(
                    f"cannot load ECConnector {name!r} from {config.ec_connector_module_path!r}: {error}"
                ) from error
        elif name in cls._registry:
            connector_cls = cls._registry[name]()
        else:
            raise InvalidEngineArgsError(
                f"ECConnector {name!r} is not registered (known: {sorted(cls._registry)}); "
                "set ec_connector_module_path to load it from a module.")
        if not (isinstance(connector_cls, type) and issubclass(connector_cls, ECConnectorBase)):
            raise InvalidEngineArgsError(f"{name!r} is not an ECConnectorBase subclass.")
        return connector_cls

    @classmethod
    def create_connector(cls, config: ECTransferConfig, role: ECConnectorRole) -> ECConnectorBase:
        return cls.get_connector_class(config)(config, role)


ECConnectorFactory.register_connector(
    "ECExampleConnector", "lm_console.engine.distributed.ec_transfer.example_connector", "ECExampleConnector")
