"""EngineArgs (user-facing knobs) -> EngineConfig (vLLM's VllmConfig): frozen sub-configs.

EngineConfig holds ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig and DeviceConfig,
plus the connector and multimodal configs. Each field has one type in every process: dtype and
device are names, paths are str. The engine core resolves the config (create_engine_config);
the frontend rebuilds it from the core's ready handshake (create_frontend_config).

One module per concept, all re-exported here (import from `engine.config`):
engine_args.py (EngineArgs, resolve_quantization), engine_config.py (EngineConfig), model.py,
cache.py, scheduler.py, parallel.py, device.py, frontend.py, structured_outputs.py,
multimodal.py, kv_transfer.py, ec_transfer.py and observability.py. Each knob is declared once, on its class, with
fields.py's knob(); EngineArgs, the `lmc` flags and the docs' reference derive from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lm_console._lazy import lazy_exports

if TYPE_CHECKING:
    from lm_console.engine.config.cache import CacheConfig, _physical_memory_bytes
    from lm_console.engine.config.device import DeviceConfig
    from lm_console.engine.config.ec_transfer import ECTransferConfig
    from lm_console.engine.config.engine_args import (
        QUANTIZATION_CHOICES,
        EngineArgs,
        _verify_tensor_parallel,
        resolve_quantization,
    )
    from lm_console.engine.config.fields import DeclaredConfig, knob
    from lm_console.engine.config.frontend import FrontendConfig
    from lm_console.engine.config.kv_transfer import KVTransferConfig
    from lm_console.engine.config.multimodal import MultiModalConfig
    from lm_console.engine.config.engine_config import EngineConfig
    from lm_console.engine.config.model import ModelConfig, load_hf_config
    from lm_console.engine.config.parallel import ParallelConfig
    from lm_console.engine.config.scheduler import SchedulerConfig
    from lm_console.engine.config.speculative import SpeculativeConfig
    from lm_console.engine.config.structured_outputs import StructuredOutputsConfig
    from lm_console.engine.config.observability import ObservabilityConfig

__all__ = [
    "QUANTIZATION_CHOICES",
    "CacheConfig",
    "DeclaredConfig",
    "DeviceConfig",
    "ECTransferConfig",
    "EngineArgs",
    "EngineConfig",
    "FrontendConfig",
    "KVTransferConfig",
    "ModelConfig",
    "MultiModalConfig",
    "ObservabilityConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
    "_physical_memory_bytes",
    "_verify_tensor_parallel",
    "knob",
    "load_hf_config",
    "resolve_quantization",
]

__getattr__ = lazy_exports(__name__, {
    "CacheConfig": "lm_console.engine.config.cache",
    "DeviceConfig": "lm_console.engine.config.device",
    "QUANTIZATION_CHOICES": "lm_console.engine.config.engine_args",
    "EngineArgs": "lm_console.engine.config.engine_args",
    "_physical_memory_bytes": "lm_console.engine.config.cache",
    "DeclaredConfig": "lm_console.engine.config.fields",
    "knob": "lm_console.engine.config.fields",
    "ECTransferConfig": "lm_console.engine.config.ec_transfer",
    "FrontendConfig": "lm_console.engine.config.frontend",
    "KVTransferConfig": "lm_console.engine.config.kv_transfer",
    "MultiModalConfig": "lm_console.engine.config.multimodal",
    "_verify_tensor_parallel": "lm_console.engine.config.engine_args",
    "resolve_quantization": "lm_console.engine.config.engine_args",
    "EngineConfig": "lm_console.engine.config.engine_config",
    "ModelConfig": "lm_console.engine.config.model",
    "load_hf_config": "lm_console.engine.config.model",
    "ParallelConfig": "lm_console.engine.config.parallel",
    "SchedulerConfig": "lm_console.engine.config.scheduler",
    "SpeculativeConfig": "lm_console.engine.config.speculative",
    "StructuredOutputsConfig": "lm_console.engine.config.structured_outputs",
    "ObservabilityConfig": "lm_console.engine.config.observability",
})
