"""EngineConfig (vLLM's VllmConfig): every resolved setting, one frozen sub-config per concern."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lm_console.engine.config.cache import CacheConfig
from lm_console.engine.config.device import DeviceConfig
from lm_console.engine.config.lora import LoRAConfig
from lm_console.engine.config.model import ModelConfig
from lm_console.engine.config.parallel import ParallelConfig
from lm_console.engine.config.scheduler import SchedulerConfig
from lm_console.engine.config.structured_outputs import StructuredOutputsConfig

if TYPE_CHECKING:
    from lm_console.engine.distributed.ec_transfer.config import ECTransferConfig
    from lm_console.engine.distributed.kv_transfer.config import KVTransferConfig
    from lm_console.engine.multimodal.config import MultiModalConfig


@dataclass(frozen=True)
class EngineConfig:
    """Every resolved setting, one frozen sub-config per concern (vLLM: VllmConfig)."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    # Connectors and multimodal settings (lm_console/engine/distributed/, lm_console/engine/multimodal/config.py).
    kv_transfer_config: KVTransferConfig | None = None
    ec_transfer_config: ECTransferConfig | None = None
    mm_config: MultiModalConfig | None = None
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    lora_config: LoRAConfig | None = None  # None: LoRA off (lm_console/engine/config/lora.py)

    def with_num_blocks(self, num_blocks: int) -> EngineConfig:
        """This config with the KV cache's block count decided (the core calls it once)."""
        return dataclasses.replace(self, cache_config=dataclasses.replace(self.cache_config, num_blocks=num_blocks))
