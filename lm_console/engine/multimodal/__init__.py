"""Multimodal inputs: image loading, hashing, HF processing, the processor cache (seed: 3550-4604).

Importing this package is cheap: PIL and transformers load only when an image is processed.
"""

from lm_console.engine.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

__all__ = ["MultiModalFeatureSpec", "PlaceholderRange"]
