"""Which model class implements which HF `config.architectures` name."""

from __future__ import annotations

from typing import Any

from lm_console.engine.errors import UnsupportedArchitectureError
from lm_console.engine.models.gemma3 import Gemma3ForCausalLM
from lm_console.engine.models.gemma3_mm import Gemma3VLForConditionalGeneration
from lm_console.engine.models.idefics3 import Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration
from lm_console.engine.models.llama import LlamaForCausalLM, MistralForCausalLM
from lm_console.engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3VLForConditionalGeneration,  # text + images
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
    "SmolVLMForConditionalGeneration": SmolVLMForConditionalGeneration,
}


def get_model_class(hf_config: Any) -> type:
    """The first of config.architectures we implement; raises naming the supported ones."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise UnsupportedArchitectureError(
        f"model architecture {architectures or '(none in config.json)'} is not supported; "
        f"supported: {', '.join(MODEL_REGISTRY)}"
    )
