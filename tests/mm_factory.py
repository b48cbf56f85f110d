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
    from lm_console.engine.models.demo_vlm import build_idefics3_dir
    from lm_console.engine.models.embedded import resolve_model_path

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


# -- Gemma3 ------------------------------------------------------------------------------------
GEMMA3_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
                   query_pre_attn_scalar=24, sliding_window=12,  # layers 0-4 local, layer 5 global
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
# 64 px images, 8 px patches: an 8x8 patch grid pooled 2x2 into 16 image tokens (> the window).
GEMMA3_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     image_size=64, patch_size=8, vision_use_head=False)
GEMMA3_MM_TOKENS = 16
_GEMMA3_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
                    "<start_of_image>", "<end_of_image>", "<image_soft_token>"]


# Gemma3's chat template, reduced to what the tests use (image parts render as <start_of_image>).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def make_gemma3_tokenizer() -> Any:
    """A tiny Gemma tokenizer (BPE with byte fallback, "▁" for spaces) whose newline runs merge
    into single tokens as in Gemma's vocabulary ("\\n", "\\n\\n", "\\n\\n\\n", ...)."""
    import string

    from transformers import GemmaTokenizer

    vocab = {token: i for i, token in enumerate(_GEMMA3_SPECIALS)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    newlines = ["\n" * n for n in range(1, 7)]
    for piece in [*string.ascii_letters, *string.digits, *".,?!:'", "▁", *newlines]:
        vocab.setdefault(piece, len(vocab))
    merges = [("\n" * a, "\n" * b) for a in range(1, 6) for b in range(1, 6) if a + b <= 6 and b <= a]
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})


def make_tiny_gemma3_vlm_dir(path: Path, seed: int = 0) -> Path:
    """Save a random tiny HF Gemma3ForConditionalGeneration + Gemma3Processor into `path`."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from lm_console.engine.models.demo_vlm import _randomize

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_gemma3_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    text = {**GEMMA3_TEXT, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    config = Gemma3Config(text_config=text, vision_config=GEMMA3_VISION, mm_tokens_per_image=GEMMA3_MM_TOKENS,
                          boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
                          image_token_index=tokenizer.image_token_id)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    _randomize(model, seed)
    with torch.no_grad():  # image embeddings on the scale of the sqrt(hidden)-scaled text embeddings
        model.model.multi_modal_projector.mm_input_projection_weight.mul_(8.0)
    model.save_pretrained(path)
    size = GEMMA3_VISION["image_size"]
    image_processor = Gemma3ImageProcessorPil(size={"height": size, "width": size})
    Gemma3Processor(image_processor, tokenizer, image_seq_length=GEMMA3_MM_TOKENS,
                    chat_template=GEMMA3_CHAT_TEMPLATE).save_pretrained(path)
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path
