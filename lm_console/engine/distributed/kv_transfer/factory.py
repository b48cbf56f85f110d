"""KVConnectorFactory: a registry of connectors imported on first use (after vLLM's KVConnectorFactory)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from lm_console.engine.distributed.kv_transfer.base import KVConnectorBase, KVConnectorRole
from lm_console.engine.errors import InvalidEngineArgsError

if TYPE_CHECKING:
    from lm_console.engine.config.engine_config import EngineConfig


class KVConnectorFactory:
    """name -> (module path, class name); kv_connector_module_path loads unregistered classes."""

    _registry: dict[str, tuple[str, str]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Register a connector by name; importing waits until it is created."""
        if name in cls._registry:
            raise ValueError(f"KV connector {name!r} is already registered.")
        cls._registry[name] = (module_path, class_name)

    @classmethod
    def get_connector_class(cls, name: str, module_path: str | None = None) -> type[KVConnectorBase]:
        """The connector class, from the registry or from module_path."""
        if module_path is None:
            if name not in cls._registry:
                raise InvalidEngineArgsError(
                    f"Unknown kv_connector {name!r}; registered: {sorted(cls._registry)} "
                    "(or set kv_connector_module_path to load your own)."
                )
            module_path, class_name = cls._registry[name]
        else:
            class_name = name
        try:
            module = importlib.import_module(module_path)
            connector_cls = getattr(module, class_name)
        except (ImportError, AttributeError) as exc:
            raise InvalidEngineArgsError(f"Cannot load KV connector {class_name!r} from {module_path!r}: {exc}.") from None
        if not (isinstance(connector_cls, type) and issubclass(connector_cls, KVConnectorBase)):
            raise InvalidEngineArgsError(f"{module_path}.{class_name} is not a KVConnectorBase subclass.")
        return connector_cls

    @classmethod
    def create_connector(cls, config: EngineConfig, role: KVConnectorRole) -> KVConnectorBase | None:
        """Build the connector for `role`, or None when config has no kv_transfer_config."""
        kv_transfer_config = config.kv_transfer_config
        if kv_transfer_config is None:
            return None
        connector_cls = cls.get_connector_class(kv_transfer_config.kv_connector,
                                                kv_transfer_config.kv_connector_module_path)
        return connector_cls(config, role, kv_transfer_config)


KVConnectorFactory.register_connector(
    "ExampleConnector", "lm_console.engine.distributed.kv_transfer.example_connector", "ExampleConnector")
KVConnectorFactory.register_connector(
    "OffloadConnector", "lm_console.engine.distributed.kv_transfer.offload.connector", "OffloadConnector")
