"""Multimodal inputs: image loading, hashing, HF processing, the processor cache.

Importing this package is cheap: PIL and transformers load only when an image is processed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lm_console._lazy import lazy_exports

if TYPE_CHECKING:
    from lm_console.engine.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

__all__ = ["MultiModalFeatureSpec", "PlaceholderRange"]

__getattr__ = lazy_exports(__name__, {
    "MultiModalFeatureSpec": "lm_console.engine.multimodal.inputs",
    "PlaceholderRange": "lm_console.engine.multimodal.inputs",
})
