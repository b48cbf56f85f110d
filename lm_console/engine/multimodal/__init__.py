"""Multimodal inputs: image loading, hashing, HF processing, the processor cache.

Importing this package is cheap: PIL and transformers load only when an image is processed.
"""

from lm_console.engine.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

__all__ = ["MultiModalFeatureSpec", "PlaceholderRange"]
