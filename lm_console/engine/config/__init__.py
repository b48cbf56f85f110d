"""EngineArgs (user-facing knobs) -> EngineConfig (vLLM's VllmConfig): frozen sub-configs.

EngineConfig holds ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig and DeviceConfig,
plus the connector and multimodal configs. Each field has one type in every process: dtype and
device are names, paths are str. The engine core resolves the config (create_engine_config);
the frontend rebuilds it from the core's ready handshake (create_frontend_config).

One module per concept, all re-exported here (import from `engine.config`):
engine_args.py (EngineArgs, resolve_quantization), engine_config.py (EngineConfig), model.py,
cache.py, scheduler.py, parallel.py, device.py and structured_outputs.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lm_console._lazy import lazy_exports

if TYPE_CHECKING:
    from lm_console.engine.config.cache import CacheConfig
    from lm_console.engine.config.device import DeviceConfig
    from lm_console.engine.config.engine_args import (
        QUANTIZATION_CHOICES,
        EngineArgs,
        _physical_memory_bytes,
        _verify_tensor_parallel,
        resolve_quantization,
    )
    from lm_console.engine.config.engine_config import EngineConfig
    from lm_console.engine.config.model import ModelConfig, load_hf_config
    from lm_console.engine.config.parallel import ParallelConfig
    from lm_console.engine.config.scheduler import SchedulerConfig
    from lm_console.engine.config.speculative import SpeculativeConfig
    from lm_console.engine.config.structured_outputs import StructuredOutputsConfig

__all__ = [
    "QUANTIZATION_CHOICES",
    "CacheConfig",
    "DeviceConfig",
    "EngineArgs",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
    "_physical_memory_bytes",
    "_verify_tensor_parallel",
    "load_hf_config",
    "resolve_quantization",
]

__getattr__ = lazy_exports(__name__, {
    "CacheConfig": "lm_console.engine.config.cache",
    "DeviceConfig": "lm_console.engine.config.device",
    "QUANTIZATION_CHOICES": "lm_console.engine.config.engine_args",
    "EngineArgs": "lm_console.engine.config.engine_args",
    "_physical_memory_bytes": "lm_console.engine.config.engine_args",
    "_verify_tensor_parallel": "lm_console.engine.config.engine_args",
    "resolve_quantization": "lm_console.engine.config.engine_args",
    "EngineConfig": "lm_console.engine.config.engine_config",
    "ModelConfig": "lm_console.engine.config.model",
    "load_hf_config": "lm_console.engine.config.model",
    "ParallelConfig": "lm_console.engine.config.parallel",
    "SchedulerConfig": "lm_console.engine.config.scheduler",
    "SpeculativeConfig": "lm_console.engine.config.speculative",
    "StructuredOutputsConfig": "lm_console.engine.config.structured_outputs",
})
