"""KVTransferConfig: the `kv_transfer_config` engine argument (after vLLM's KVTransferConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from lm_console.engine.config.fields import DeclaredConfig, json_object_arg, knob
from lm_console.engine.errors import InvalidEngineArgsError

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KV_ROLES: tuple[str, ...] = KVRole.__args__  # type: ignore[attr-defined]


@dataclass
class KVTransferConfig(DeclaredConfig):
    """Which connector to build and how (after vLLM's KVTransferConfig).

    kv_role: kv_producer stores KV, kv_consumer loads it, kv_both does both.
    kv_connector_module_path: import path of a connector not in the factory's registry.
    kv_connector_extra_config: connector-specific settings (e.g. cpu_bytes, disk_path, disk_bytes,
    chunk_size for the OffloadConnector).
    """

    kv_connector: str
    kv_role: KVRole = knob("kv_both", user=False, arg="kv_transfer_config.kv_role",
                           help="kv_producer stores KV, kv_consumer loads it, kv_both does both.")
    kv_connector_module_path: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    engine_id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise InvalidEngineArgsError("kv_transfer_config.kv_connector must name a connector class.")
        super().__post_init__()  # kv_role, from its declaration
        if not isinstance(self.kv_connector_extra_config, dict):
            raise InvalidEngineArgsError("kv_transfer_config.kv_connector_extra_config must be a dict.")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def parse(cls, value: KVTransferConfig | dict[str, Any] | str | None) -> KVTransferConfig | None:
        """Accept a KVTransferConfig, a dict or a JSON string; None stays None."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        known = {"kv_connector", "kv_role", "kv_connector_module_path", "kv_connector_extra_config", "engine_id"}
        value = json_object_arg(value, "kv_transfer_config", known)
        if "kv_connector" not in value:
            raise InvalidEngineArgsError("kv_transfer_config needs 'kv_connector' (e.g. 'OffloadConnector').")
        return cls(**value)
