"""ModelConfig: the model and its facts, read once from its Hugging Face config."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Literal

from lm_console.engine.config.fields import DeclaredConfig, declare, knob
from lm_console.engine.errors import InvalidEngineArgsError, InvalidModelConfigError


# The names engine.platform.resolve_dtype maps (its aliases included: bf16, fp16, half, ...).
ModelDType = Literal["auto", "float32", "bfloat16", "float16", "fp32", "float", "bf16", "fp16", "half"]
Quantization = Literal[None, "auto", "none", "gguf", "int8"]


@dataclass(frozen=True)
class ModelConfig(DeclaredConfig):
    """The model and the facts about it that the layers need, resolved once from config.json.

    The engine core resolves it (create_engine_config) and sends it in the ready handshake, so the
    frontend holds the same values. Paths are str (one type in every process and on the wire);
    dtype is a name (engine.platform.torch_dtype gives the torch dtype where torch is used).
    For a VLM the facts are the language model's (its text_config). The knobs' EngineArgs forms
    (`model`, `tokenizer`, dtype "auto", max_model_len None) are resolved into these facts.
    """

    model_name: str = field(metadata=declare(
        arg="model", arg_type=str | None, arg_default=None, cli="--model -m",
        help="Model name, HF-format directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)."))
    model_dir: str  # a Hugging Face-format directory
    tokenizer_dir: str = field(metadata=declare(
        arg="tokenizer", arg_type=str | None, arg_default=None, cli=None,
        help="The tokenizer's directory (default: the model's)."))
    architectures: tuple[str, ...]  # config.json's architectures (the model registry's key)
    is_multimodal: bool  # an image pipeline exists for the architecture (lm_console/engine/multimodal/processing.py)
    # Resolved: float32 | bfloat16 | float16 ("none" for the fake engine, which has no weights).
    dtype: str = field(metadata=declare(
        arg_type=ModelDType, arg_default="auto",
        help="auto | float32 | bfloat16 | float16, or bf16, fp16, half, fp32, float (auto: bfloat16 on "
             "CUDA and where the CPU computes it fast, else float32)."))
    seed: int = field(metadata=declare(arg_default=0, cli=None, help="The engine's random seed."))
    max_model_len: int = field(metadata=declare(
        ge=1, arg_type=int | None, arg_default=None,
        help="Longest prompt + output, in tokens (default: the model's, capped at 8192)."))
    max_position_embeddings: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    # None = auto (a GGUF model in bf16 on the CPU keeps its file's weights, the fastest measured;
    # LMC_QUANT_AUTO=0: dense); resolved: "gguf", "int8" or None (dense); resolve_quantization.
    quantization: Quantization = knob(
        None, help="None/auto | none (dense) | gguf (a GGUF model's own weights) | int8 (per-channel "
                             "int8 weights, dynamic int8 activations) (docs/quantized-cpu.md).")
    max_logprobs: int = knob(20, ge=-1, cli=None,
                             help="Most logprobs per token a request may ask for (vLLM's max_logprobs; -1: no limit).")
    intermediate_size: int = 0  # the MLP's width (LoRA adapters' shapes are checked against it)

    @classmethod
    def from_model_dir(cls, model_dir: str, *, model_name: str, tokenizer_dir: str, dtype: str, seed: int,
                       max_model_len: int | None, quantization: Quantization = None,
                       max_logprobs: int = 20) -> ModelConfig:
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
            quantization=quantization, max_logprobs=max_logprobs,
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
