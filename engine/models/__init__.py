"""Our own model code (paged-KV attention), the registry, weight loading, the embedded model.

Attributes load lazily so that `engine.models.embedded` (model listing, path resolution) can be
imported without paying for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "load_model": "engine.models.loader",
    "MODEL_REGISTRY": "engine.models.registry",
    "get_model_class": "engine.models.registry",
    "DEFAULT_MODEL": "engine.models.embedded",
    "list_known_models": "engine.models.embedded",
    "resolve_model_path": "engine.models.embedded",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'engine.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
