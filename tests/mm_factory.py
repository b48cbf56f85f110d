"""Tiny random-weight Idefics3 (SmolVLM-style) models and test images.

The directory holds config, safetensors weights, the embedded model's tokenizer with the image
tokens added, and a saved Idefics3 processor (32 px tiles, 4 embeddings a tile, up to 2x2 tiles
plus the global image), so transformers' own model and processor serve as the reference.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
                 bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   image_size=32, patch_size=8)


def make_tiny_idefics3_dir(path: Path, seed: int = 0, **processor: Any) -> Path:
    from engine.models.demo_vlm import build_idefics3_dir
    from engine.models.embedded import resolve_model_path

    return build_idefics3_dir(Path(path), resolve_model_path(None), TINY_TEXT, TINY_VISION, seed=seed,
                              longest_edge=processor.get("longest_edge", 64),
                              max_image_size=processor.get("max_image_size", 32),
                              do_image_splitting=processor.get("do_image_splitting", True))


def make_image(seed: int, width: int = 56, height: int = 40) -> Any:
    """A random RGB PIL image (distinct seeds give distinct images)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def png_bytes(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
