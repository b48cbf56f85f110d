"""ECTransferConfig: which ECConnector, in which role (after vLLM's ECTransferConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from lm_console.engine.config.fields import DeclaredConfig, json_object_arg, knob
from lm_console.engine.errors import InvalidEngineArgsError

ECRole = Literal["ec_producer", "ec_consumer", "ec_both"]


@dataclass(slots=True)
class ECTransferConfig(DeclaredConfig):
    """The `ec_transfer_config` engine argument, validated.

    ec_producer: this engine only runs encoders and saves their outputs (no decoder, no KV);
    ec_consumer: it loads encoder outputs from the connector instead of computing them;
    ec_both: it does both.
    """

    ec_connector: str = "ECExampleConnector"
    ec_role: ECRole = knob(
        "ec_consumer", user=False, arg="ec_role",
        help="ec_producer runs encoders only, ec_consumer loads encoder outputs, ec_both does both.")
    ec_connector_module_path: str | None = None  # load ec_connector from this module instead
    ec_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def is_ec_producer(self) -> bool:
        return self.ec_role in ("ec_producer", "ec_both")

    @property
    def is_ec_consumer(self) -> bool:
        return self.ec_role in ("ec_consumer", "ec_both")

    @property
    def is_producer_only(self) -> bool:
        """An encoder-only engine: runs encoders, skips the decoder, allocates no KV cache."""
        return self.ec_role == "ec_producer"

    @classmethod
    def from_arg(cls, value: dict[str, Any] | str | ECTransferConfig) -> ECTransferConfig:
        """Build from a dict or a JSON string, naming unknown keys and bad roles."""
        if isinstance(value, ECTransferConfig):
            return value
        value = json_object_arg(value, "ec_transfer_config", {f.name for f in fields(cls)})
        config = cls(**value)  # ec_role checked by its declaration
        if not isinstance(config.ec_connector_extra_config, dict):
            raise InvalidEngineArgsError("ec_connector_extra_config must be a dict.")
        return config
