"""ModelConfig: the model and its facts, read once from its Hugging Face config."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from lm_console.engine.errors import InvalidEngineArgsError, InvalidModelConfigError


@dataclass(frozen=True)
class ModelConfig:
    """The model and the facts about it that the layers need, resolved once from config.json.

    The engine core resolves it (create_engine_config) and sends it in the ready handshake, so the
    frontend holds the same values. Paths are str (one type in every process and on the wire);
    dtype is a name (engine.platform.torch_dtype gives the torch dtype where torch is used).
    For a VLM the facts are the language model's (its text_config).
    """

    model_name: str  # as the user named it (the embedded default's name for None)
    model_dir: str  # a Hugging Face-format directory
    tokenizer_dir: str
    architectures: tuple[str, ...]  # config.json's architectures (the model registry's key)
    is_multimodal: bool  # an image pipeline exists for the architecture (lm_console/engine/multimodal/processing.py)
    dtype: str  # float32 | bfloat16 | float16
    seed: int
    max_model_len: int
    max_position_embeddings: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    quantization: str | None = None  # "gguf" | "int8" | None (dense); resolve_quantization
    intermediate_size: int = 0  # the MLP's width (LoRA adapters' shapes are checked against it)

    @classmethod
    def from_model_dir(cls, model_dir: str, *, model_name: str, tokenizer_dir: str, dtype: str, seed: int,
                       max_model_len: int | None, quantization: str | None = None) -> ModelConfig:
        """Read the model's facts from model_dir's config; max_model_len None: the model's (capped)."""
        from lm_console.engine.multimodal.processing import is_multimodal_architecture

        hf_config = load_hf_config(model_dir)
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        # A config without max_position_embeddings is taken as a 2048-token model; one that says
        # 0 (or less) is refused here: its rope tables would be empty and the first request
        # would end the engine.
        model_max = getattr(text, "max_position_embeddings", None)
        model_max = 2048 if model_max is None else model_max
        if isinstance(model_max, float) and model_max.is_integer():
            model_max = int(model_max)
        if isinstance(model_max, bool) or not isinstance(model_max, int) or model_max < 1:
            raise InvalidModelConfigError(
                f"{model_dir}/config.json has max_position_embeddings={model_max!r:.40}: it must be an integer >= 1 "
                "(the model's context length); fix the config or re-convert the model.")
        max_model_len = max_model_len or min(model_max, 8192)
        if max_model_len > model_max:
            raise InvalidEngineArgsError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={model_max}."
            )
        num_attention_heads = int(text.num_attention_heads)
        architectures = tuple(getattr(hf_config, "architectures", None) or ())
        return cls(
            model_name=model_name, model_dir=model_dir, tokenizer_dir=tokenizer_dir, architectures=architectures,
            is_multimodal=is_multimodal_architecture(architectures), dtype=dtype, seed=seed,
            max_model_len=max_model_len, max_position_embeddings=model_max, vocab_size=int(text.vocab_size),
            hidden_size=int(text.hidden_size), num_layers=int(text.num_hidden_layers),
            num_attention_heads=num_attention_heads,
            num_kv_heads=int(getattr(text, "num_key_value_heads", None) or num_attention_heads),
            head_dim=int(getattr(text, "head_dim", None) or int(text.hidden_size) // num_attention_heads),
            quantization=quantization,
            intermediate_size=int(getattr(text, "intermediate_size", 0) or 0),
        )

    @property
    def hf_config(self) -> Any:
        """The transformers config of model_dir, the one place it is held (loaded once per process).

        The model code and the core's multimodal budget read it. transformers imports torch
        with it, so the frontend never asks for it.
        """
        return load_hf_config(self.model_dir)


@functools.lru_cache(maxsize=8)
def load_hf_config(model_dir: str) -> Any:
    """model_dir's HF config, once per process: a plain Llama's read without transformers (its
    import is a quarter of a cold start; lm_console/engine/config/plain_llama_config.py), any other through
    transformers' AutoConfig (which imports transformers and torch)."""
    from lm_console.engine.config.plain_llama_config import read_plain_llama_config

    plain = read_plain_llama_config(model_dir)
    if plain is not None:
        return plain
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)
