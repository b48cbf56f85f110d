"""Tiny random-weight HF models that transformers and our engine both load.

The weights are saved with `save_pretrained` (float32 safetensors) beside a copy of the embedded
model's tokenizer, so `AutoModelForCausalLM` / `AutoTokenizer` serve as the reference on exactly
the directory our engine reads.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

# A llama3-style rope scaling small enough that a 2048-position test crosses its bands.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "generation_config.json",
)

_ARCHS = {
    # arch: (config class name, per-arch config fields)
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    "mistral": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": 24}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False, "attention_bias": False}),
    # Gemma3 text (gemma-3-1b style): a small window so that prompts of a few blocks cross it,
    # query_pre_attn_scalar != head_dim, distinct RoPE bases for global and local layers.
    "gemma3": ("Gemma3TextConfig", {
        "tie_word_embeddings": False, "sliding_window": 24, "query_pre_attn_scalar": 24,
        "num_hidden_layers": 6,  # the default 5:1 pattern: layers 0-4 local, layer 5 global
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    }),
}


def tiny_config(arch: str, vocab_size: int, **overrides: Any) -> Any:
    """A small HF config of the given architecture (hidden 64, 4 heads / 2 KV heads of 16)."""
    import transformers

    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(_ARCHS)}")
    class_name, arch_fields = _ARCHS[arch]
    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        **arch_fields,
        **overrides,
    }
    return getattr(transformers, class_name)(**fields)


def _randomize(model: Any, seed: int) -> None:
    """Weights with O(1) activations and logits spread over several units (not HF's 0.02)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)


def make_tiny_model_dir(path: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a random tiny `arch` model ("llama", "qwen2", "qwen3", "mistral") into `path`."""
    import torch
    from transformers import AutoModelForCausalLM

    from lm_console.engine.models.embedded import resolve_model_path

    tokenizer_dir = resolve_model_path(None)
    vocab_size = overrides.pop("vocab_size", None)
    if vocab_size is None:
        import json

        vocab_size = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = tiny_config(arch, vocab_size, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    model.save_pretrained(path)  # after the copy: its generation_config.json wins
    return path
