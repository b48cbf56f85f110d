"""EngineConfig (vLLM's VllmConfig): every resolved setting, one frozen sub-config per concern."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lm_console.engine.config.cache import CacheConfig
from lm_console.engine.config.device import DeviceConfig
from lm_console.engine.config.ec_transfer import ECTransferConfig
from lm_console.engine.config.fields import knob
from lm_console.engine.config.kv_transfer import KVTransferConfig
from lm_console.engine.config.lora import LoRAConfig
from lm_console.engine.config.model import ModelConfig
from lm_console.engine.config.multimodal import MultiModalConfig
from lm_console.engine.config.observability import ObservabilityConfig
from lm_console.engine.config.parallel import ParallelConfig
from lm_console.engine.config.scheduler import SchedulerConfig
from lm_console.engine.config.speculative import SpeculativeConfig
from lm_console.engine.config.structured_outputs import StructuredOutputsConfig


def _parse_ec_transfer_config(value: Any) -> ECTransferConfig | None:
    return None if value is None else ECTransferConfig.from_arg(value)


@dataclass(frozen=True)
class EngineConfig:
    """Every resolved setting, one frozen sub-config per concern (vLLM: VllmConfig)."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    # The connectors' knobs are whole configs, given as a dict or a JSON string
    # (lm_console/engine/distributed/); `lmc` builds kv_transfer_config from --kv-transfer-config
    # or the --kv-offload flags (lm_console/kv_options.py).
    kv_transfer_config: KVTransferConfig | None = knob(
        None, arg_type=Any, parse=KVTransferConfig.parse, cli=None,
        help='The KV connector, a dict or JSON string, e.g. {"kv_connector": "OffloadConnector", "kv_role": '
             '"kv_both", "kv_connector_extra_config": {...}} (lmc: --kv-transfer-config, --kv-offload).')
    ec_transfer_config: ECTransferConfig | None = knob(
        None, arg_type=dict[str, Any] | str | None, parse=_parse_ec_transfer_config, cli=None,
        help="The encoder-cache connector, a dict or JSON string (ec_connector, ec_role, ...).")
    mm_config: MultiModalConfig | None = None
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    speculative_config: SpeculativeConfig | None = knob(
        None, arg_type=dict[str, Any] | str | None, parse=SpeculativeConfig.parse, cli=None,
        help='Speculative decoding, a dict or JSON string (vLLM\'s), e.g. {"method": "ngram", '
             '"num_speculative_tokens": 3}; methods ngram and suffix (lmc: --speculative-config); None: off.')
    lora_config: LoRAConfig | None = None  # None: LoRA off (lm_console/engine/config/lora.py)

    def with_num_blocks(self, num_blocks: int) -> EngineConfig:
        """This config with the KV cache's block count decided (the core calls it once)."""
        return dataclasses.replace(self, cache_config=dataclasses.replace(self.cache_config, num_blocks=num_blocks))
