"""Build Idefics3-format VLM directories: the built-in demo VLM and the tests' tiny VLMs.

No VLM weights ship on PyPI, so `demo-vlm` is the embedded SmolLM2 (frozen) with a small SigLIP
tower and Idefics3 connector trained by tools/train_demo_vlm.py on synthetic pictures
(lm_console/engine/models/demo_vlm_pictures.py: 1-4 shapes of one colour at one side). Their weights ship
as demo_vlm_vision.safetensors next to this module. The connector's 16 vectors per picture are
the LM's embeddings of the picture's caption ("Two red squares on the left."), so the LM reads
the picture as a caption and answers about its shapes, colours, counts and position; on other
pictures it sees only the nearest such caption. The directory is written once, atomically,
under the model cache (see lm_console/engine/models/embedded.py).
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
DEMO_VLM_LABEL = ("sees synthetic pictures: shapes, colours, counts 1-4, positions; "
                  "other pictures only as the nearest such scene")
_DEMO_VERSION = "4"  # bump when the recipe below (or the trained weights) changes

# The vision side tools/train_demo_vlm.py trains: 128 px pictures (no tiling), 8x8 patches of
# 16 px, pixel-shuffled 2x2 into 16 image embeddings (image_seq_len).
DEMO_VISION_CONFIG = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "image_size": 128, "patch_size": 16}
DEMO_SCALE_FACTOR = 2
DEMO_IMAGE_SEQ_LEN = (128 // 16) ** 2 // DEMO_SCALE_FACTOR**2
DEMO_VISION_WEIGHTS = "demo_vlm_vision.safetensors"

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


def caption_slots(tokenizer: Any, scene: Any) -> list[int]:
    """The token ids demo-vlm's connector learns to emit for a picture of `scene`: its caption,
    then spaces up to DEMO_IMAGE_SEQ_LEN."""
    from lm_console.engine.models.demo_vlm_pictures import caption

    ids = tokenizer(caption(scene), add_special_tokens=False)["input_ids"]
    space = tokenizer(" ", add_special_tokens=False)["input_ids"]
    if len(ids) > DEMO_IMAGE_SEQ_LEN or len(space) != 1:
        raise ValueError(f"caption {caption(scene)!r} does not fit {DEMO_IMAGE_SEQ_LEN} image embeddings")
    return ids + space * (DEMO_IMAGE_SEQ_LEN - len(ids))


def build_idefics3_dir(path: Path, tokenizer_dir: Path, text_config: dict[str, Any],
                       vision_config: dict[str, Any], *, scale_factor: int = 2, longest_edge: int = 64,
                       max_image_size: int = 32, seed: int = 0, text_weights_dir: Path | None = None,
                       do_image_splitting: bool = True, vision_weights: Path | None = None) -> Path:
    """Save an HF Idefics3 model + processor into `path`.

    The LM is random (seeded) unless text_weights_dir gives a Llama checkpoint to copy in; the
    tower and connector are random unless vision_weights gives a safetensors file of their
    `model.vision_model.*` / `model.connector.*` tensors (all of them, or ValueError). The
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
    if vision_weights is not None:
        _load_vision_weights(model, Path(vision_weights))
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


def _load_vision_weights(model: Any, file: Path) -> None:
    """Copy trained tower + connector tensors in; every one of them must be present and fit."""
    from safetensors.torch import load_file
    import torch

    params = {name: p for name, p in model.named_parameters()
              if name.startswith(("model.vision_model.", "model.connector."))}
    tensors = load_file(str(file))
    missing = sorted(set(params) - set(tensors))
    unknown = sorted(set(tensors) - set(params))
    if missing or unknown:
        raise ValueError(f"{file}: vision weights do not match the model (missing {missing[:3]}, "
                         f"unexpected {unknown[:3]})")
    with torch.no_grad():
        for name, param in params.items():
            if tensors[name].shape != param.shape:
                raise ValueError(f"{file}: {name} has shape {tuple(tensors[name].shape)}, the model "
                                 f"wants {tuple(param.shape)}")
            param.copy_(tensors[name].to(param.dtype))


def demo_vlm_target(models_dir: Path) -> Path:
    """Where the demo VLM lives (built or not) in the model cache `models_dir`: named by the recipe
    version and the trained weights' digest, so retrained weights never meet a stale build."""
    import hashlib

    digest = hashlib.sha256(Path(__file__).with_name(DEMO_VISION_WEIGHTS).read_bytes()).hexdigest()[:12]
    return models_dir / f"{DEMO_VLM_NAME}-v{_DEMO_VERSION}-{digest}"


def demo_vlm_dir(models_dir: Path, text_model_dir: Callable[[], Path]) -> Path:
    """The demo VLM's directory, built once (atomically) from the LM text_model_dir() returns.

    lm_console/engine/models/embedded.py passes its model cache and the embedded SmolLM2 (resolved only
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
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-demo-vlm-"))
    try:
        build_idefics3_dir(tmp, text_dir, text_config, DEMO_VISION_CONFIG, scale_factor=DEMO_SCALE_FACTOR,
                           longest_edge=128, max_image_size=128, seed=1234, text_weights_dir=text_dir,
                           do_image_splitting=False, vision_weights=Path(__file__).with_name(DEMO_VISION_WEIGHTS))
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
