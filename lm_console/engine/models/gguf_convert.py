"""Convert a GGUF file (llama, qwen2, qwen3, gemma3) into a Hugging Face-format directory.

Weights are dequantized with the `gguf` package to float32 (so our model and HF transformers
read bit-identical values) and undone from llama.cpp's storage conventions (q/k row order for
llama, 1 + w norms for gemma3: see gguf_arch.py); config.json is built from the GGUF metadata;
the tokenizer and chat template come from transformers' GGUF tokenizer reader (the file's
tokenizer.ggml.* keys, read through the `gguf` package).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from lm_console.engine.models.gguf_arch import (  # noqa: F401 - re-exported: the converter's public names
    SUPPORTED_GGUF_ARCHITECTURES, end_of_generation_ids, gguf_architecture, gguf_config_dict,
    hf_tensor_name, is_norm, permuted_rope_heads, unpermute_rope_rows,
)
from lm_console.engine.models.gguf_arch import _field
from lm_console.engine.models.gguf_check import check_gguf, invalid

# Tensors the file may carry that are not checkpoint weights (read as metadata instead).
_METADATA_TENSORS = ("rope_freqs.weight",)


def gguf_state_dict(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """HF-named float32 torch tensors, dequantized, in HF's layout and norm convention."""
    import torch
    from gguf.quants import dequantize

    arch = gguf_architecture(reader)
    tensors = {}
    for t in reader.tensors:
        if t.name in _METADATA_TENSORS:
            continue
        name = hf_tensor_name(t.name, arch)
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
        array = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        rope_heads = permuted_rope_heads(name, arch, config["num_attention_heads"], config["num_key_value_heads"])
        if rope_heads is not None:
            array = unpermute_rope_rows(array, rope_heads)
        if arch.norm_shift and is_norm(name):
            array = array - np.float32(arch.norm_shift)
        if not (array.flags.writeable and array.flags.c_contiguous):
            array = np.array(array)  # F32 tensors are read-only views of the memory map
        tensors[name] = torch.from_numpy(array)
    return tensors


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, generation_config.json, model.safetensors and tokenizer files."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

    gguf_path = Path(gguf_path)
    # Every declared size and the metadata against the tensors, before anything is allocated
    # from them (InvalidGGUFError naming the file): a bad file never becomes a cached model.
    reader, config_dict = check_gguf(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    fields = {k: v for k, v in config_dict.items() if k not in ("model_type", "architectures")}
    config = AutoConfig.for_model(config_dict["model_type"], **fields)
    config.architectures = config_dict["architectures"]
    config.save_pretrained(out_dir)
    stop_ids = end_of_generation_ids(reader)
    GenerationConfig(
        bos_token_id=config_dict["bos_token_id"],
        eos_token_id=stop_ids if len(stop_ids) > 1 else config_dict["eos_token_id"],
        pad_token_id=config_dict["pad_token_id"],
    ).save_pretrained(out_dir)
    save_file(gguf_state_dict(reader, config_dict), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    chat_template = _field(reader, "tokenizer.chat_template")
    # A byte-level (gpt2) vocabulary in a file whose model_type's tokenizer class is Gemma's
    # sentencepiece one (llama.cpp writes gpt2 for a gemma3 checkpoint without tokenizer.model):
    # the generic class keeps the file's byte-level tokenizer as transformers builds it.
    generic = (gguf_architecture(reader).sentencepiece_class
               and _field(reader, "tokenizer.ggml.model") == "gpt2")
    del reader  # release the memory map before the tokenizer reads the file again

    tokenizer_cls = PreTrainedTokenizerFast if generic else AutoTokenizer
    try:
        tokenizer = tokenizer_cls.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as error:  # noqa: BLE001 - the tokenizers library raises a bare Exception
        # transformers' GGUF tokenizer reader on metadata of the wrong shape or an inconsistent
        # vocabulary (merges of tokens it lacks): the file's tokenizer cannot be built
        raise invalid(gguf_path, f"its tokenizer metadata cannot be read ({type(error).__name__}: "
                                 f"{' '.join(str(error).split())[:200]})") from None
    tokenizer.save_pretrained(out_dir)
    _ensure_chat_template(out_dir, chat_template)


def _ensure_chat_template(out_dir: Path, template: str | None) -> None:
    """Put the chat template into tokenizer_config.json (transformers 5 may save it aside)."""
    if template is None:
        jinja = out_dir / "chat_template.jinja"
        template = jinja.read_text() if jinja.exists() else None
    if template is None:
        return
    path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(path.read_text())
    if tok_config.get("chat_template") != template:
        tok_config["chat_template"] = template
        path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
