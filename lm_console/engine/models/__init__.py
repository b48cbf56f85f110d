"""Our own model code (paged-KV attention), the registry, weight loading, the embedded model.

Attributes load lazily so that `engine.models.embedded` (model listing, path resolution) can be
imported without paying for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "load_model": "lm_console.engine.models.loader",
    "MODEL_REGISTRY": "lm_console.engine.models.registry",
    "get_model_class": "lm_console.engine.models.registry",
    "DEFAULT_MODEL": "lm_console.engine.models.embedded",
    "list_known_models": "lm_console.engine.models.embedded",
    "resolve_model_path": "lm_console.engine.models.embedded",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lm_console.engine.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
