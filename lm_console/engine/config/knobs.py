"""The engine's knobs: which config classes give EngineArgs its fields, in order.

Kept apart from engine_args.py so that the `lmc` flags (lm_console/engine_options.py) and the docs
read the declarations without importing what EngineArgs resolves with.
"""

from __future__ import annotations

import functools

from lm_console.engine.config.cache import CacheConfig
from lm_console.engine.config.device import DeviceConfig
from lm_console.engine.config.engine_config import EngineConfig
from lm_console.engine.config.fields import Declaration, engine_knobs
from lm_console.engine.config.frontend import FrontendConfig
from lm_console.engine.config.lora import LoRAConfig
from lm_console.engine.config.model import ModelConfig
from lm_console.engine.config.multimodal import MultiModalConfig
from lm_console.engine.config.observability import ObservabilityConfig
from lm_console.engine.config.parallel import ParallelConfig
from lm_console.engine.config.scheduler import SchedulerConfig

# A new config class (config/lora.py, config/speculative.py) adds itself here and maps its fields
# in EngineArgs.create_engine_config; its knobs then appear on EngineArgs, in the docs and (cli=)
# as `lmc` flags.
ENGINE_ARG_SOURCES: tuple[type, ...] = (
    ModelConfig, CacheConfig, SchedulerConfig, DeviceConfig, ParallelConfig, FrontendConfig, MultiModalConfig,
    ObservabilityConfig, EngineConfig, LoRAConfig,
)


@functools.cache
def engine_arg_declarations() -> dict[str, Declaration]:
    """EngineArgs keyword -> its knob's declaration (ValueError on a keyword declared twice)."""
    return collect(ENGINE_ARG_SOURCES)


def collect(classes: tuple[type, ...]) -> dict[str, Declaration]:
    """Keyword -> declaration over these classes' user knobs (ValueError on a keyword declared twice)."""
    found: dict[str, Declaration] = {}
    for decl in engine_knobs(classes):
        if decl.arg in found:
            first = found[decl.arg]
            raise ValueError(f"EngineArgs keyword {decl.arg!r} is declared twice: on {first.owner.__name__}."
                             f"{first.field} and on {decl.owner.__name__}.{decl.field}.")
        found[decl.arg] = decl
    return found
