"""Build Idefics3-format VLM directories: the built-in demo VLM and the tests' tiny VLMs.

No VLM weights ship on PyPI, so `demo-vlm` is the embedded SmolLM2 with a seeded, randomly
initialised SigLIP tower and Idefics3 connector: it exercises the whole image pipeline (HF
processor, hashing, encoder cache, placeholder merge) but its answers ignore the image. It is
written once, atomically, under the model cache (see engine/models/embedded.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEMO_VLM_NAME = "demo-vlm"
DEMO_VLM_LABEL = "untrained vision tower: answers ignore the image"
_DEMO_VERSION = "3"  # bump when the recipe below changes

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]

# ChatML (SmolLM2's format) where a message's content may be a string or a list of parts;
# image parts render as the processor's <image> placeholder.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_idefics3_dir(path: Path, tokenizer_dir: Path, text_config: dict[str, Any],
                       vision_config: dict[str, Any], *, scale_factor: int = 2, longest_edge: int = 64,
                       max_image_size: int = 32, seed: int = 0, text_weights_dir: Path | None = None,
                       do_image_splitting: bool = True) -> Path:
    """Save an HF Idefics3 model + processor into `path`.

    The LM is random (seeded) unless text_weights_dir gives a Llama checkpoint to copy in; the
    tokenizer of tokenizer_dir gains the Idefics3 image tokens. transformers'
    Idefics3ForConditionalGeneration and AutoProcessor load the result.
    """
    import torch
    from transformers import (AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration,
                              Idefics3Processor)
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    vocab_size = len(tokenizer)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    text = {"model_type": "llama", **text_config, "vocab_size": vocab_size}
    config = Idefics3Config(vision_config={"model_type": "idefics3_vision", **vision_config}, text_config=text,
                            scale_factor=scale_factor, image_token_id=image_token_id,
                            tie_word_embeddings=bool(text_config.get("tie_word_embeddings", False)))
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    _randomize(model, seed)
    if text_weights_dir is not None:
        _copy_text_weights(model, Path(text_weights_dir))
    model.save_pretrained(path)
    image_processor = Idefics3ImageProcessorPil(
        do_resize=True, size={"longest_edge": longest_edge}, max_image_size={"longest_edge": max_image_size},
        do_image_splitting=do_image_splitting)
    patches = (vision_config["image_size"] // vision_config["patch_size"]) ** 2
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=patches // scale_factor**2,
                                  chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    for name in ("generation_config.json",):
        if (Path(tokenizer_dir) / name).exists() and not (path / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, path / name)
    return path


def _randomize(model: Any, seed: int) -> None:
    """O(1) activations: unit-ish norms, small biases, 1/sqrt(fan_in) matrices."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            elif "embed_tokens" in name or "position_embedding" in name:
                param.copy_(noise if "embed_tokens" in name else 0.5 * noise)
            else:
                fan_in = param[0].numel() if param.dim() > 1 else param.shape[-1]
                param.copy_(noise / fan_in**0.5)


def _copy_text_weights(model: Any, text_dir: Path) -> None:
    """Copy a Llama checkpoint into the VLM's text model; new token rows keep their random init."""
    from safetensors.torch import load_file
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for file in sorted(text_dir.glob("*.safetensors")):
            for name, tensor in load_file(str(file)).items():
                target = "lm_head.weight" if name == "lm_head.weight" else "model.text_model." + name.removeprefix("model.")
                if target not in params:
                    continue
                param = params[target]
                if param.shape == tensor.shape:
                    param.copy_(tensor)
                else:  # the embedding grew by the image tokens: keep the old rows, and zero the
                    # new ones so that the (tied) head never prefers an image token
                    param[: tensor.shape[0]].copy_(tensor)
                    param[tensor.shape[0]:].zero_()
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    # The random connector's outputs have unit scale; the LM's token embeddings are far smaller.
    # Match them, so the image tokens perturb the LM instead of drowning the text.
    with torch.no_grad():
        embed = model.model.text_model.embed_tokens.weight
        model.model.connector.modality_projection.proj.weight.mul_(float(embed.float().std()))


def demo_vlm_target(models_dir: Path) -> Path:
    """Where the demo VLM lives (built or not) in the model cache `models_dir`."""
    return models_dir / f"{DEMO_VLM_NAME}-v{_DEMO_VERSION}"


def demo_vlm_dir(models_dir: Path, text_model_dir: Callable[[], Path]) -> Path:
    """The demo VLM's directory, built once (atomically) from the LM text_model_dir() returns.

    engine/models/embedded.py passes its model cache and the embedded SmolLM2 (resolved only
    when the demo VLM must be built).
    """
    target = demo_vlm_target(models_dir)
    if (target / "config.json").is_file():
        return target
    text_dir = text_model_dir()
    text = json.loads((text_dir / "config.json").read_text())
    text_config = {k: text[k] for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id", "pad_token_id",
        "tie_word_embeddings", "rope_theta", "rope_parameters", "rope_scaling", "head_dim") if k in text}
    vision_config = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "image_size": 128, "patch_size": 16}
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-demo-vlm-"))
    try:
        build_idefics3_dir(tmp, text_dir, text_config, vision_config, scale_factor=2, longest_edge=256,
                           max_image_size=128, seed=1234, text_weights_dir=text_dir)
        (tmp / "lmc_demo.json").write_text(json.dumps({"label": DEMO_VLM_LABEL, "version": _DEMO_VERSION}))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def is_demo_vlm_dir(path: Path) -> bool:
    return (Path(path) / "lmc_demo.json").is_file()
