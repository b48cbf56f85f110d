"""Convert a llama-architecture GGUF file into a Hugging Face-format directory.

Weights are dequantized with the `gguf` package to float32 (so our model and HF transformers
read bit-identical values) and Q/K rows are un-permuted back to HF's rotate-halves layout;
config.json is built from the GGUF metadata; the tokenizer and chat template come from
transformers' GGUF tokenizer reader.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import UnsupportedArchitectureError

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

# GGUF tensor name -> HF name; "{i}" is the layer index.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_tensor_name(gguf_name: str) -> str:
    """HF checkpoint name of a llama GGUF tensor name."""
    match = _LAYER_RE.fullmatch(gguf_name)
    if match:
        layer, part, kind = match.groups()
        if part not in _LAYER_NAMES:
            raise UnsupportedArchitectureError(f"GGUF tensor {gguf_name!r} is not supported")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base not in _GLOBAL_NAMES:
        raise UnsupportedArchitectureError(f"GGUF tensor {gguf_name!r} is not supported")
    return f"{_GLOBAL_NAMES[base]}.{kind}"


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-rope row order for a q/k projection [heads*D, in]."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def gguf_config_dict(reader: Any) -> dict[str, Any]:
    """HF LlamaConfig fields from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise UnsupportedArchitectureError("GGUF files with rope_freqs (llama3 scaling) are not "
                                           "supported; use the HF safetensors checkpoint")

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    num_heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(meta("vocab_size", len(tokens.data))),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", num_heads)),
        "head_dim": int(meta("attention.key_length", hidden // num_heads)),
        "max_position_embeddings": int(meta("context_length")),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    scaling = meta("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise UnsupportedArchitectureError(f"GGUF rope scaling {scaling!r} is not supported")
        factor = float(meta("rope.scaling.factor"))
        config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    return config


def gguf_state_dict(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """HF-named float32 torch tensors, dequantized, with q/k rows un-permuted."""
    import torch
    from gguf.quants import dequantize

    tensors = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
        array = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        if name.endswith("self_attn.q_proj.weight"):
            array = unpermute_rope_rows(array, config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            array = unpermute_rope_rows(array, config["num_key_value_heads"])
        if not (array.flags.writeable and array.flags.c_contiguous):
            array = np.array(array)  # F32 tensors are read-only views of the memory map
        tensors[name] = torch.from_numpy(array)
    return tensors


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, generation_config.json, model.safetensors and tokenizer files."""
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig

    gguf_path = Path(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(gguf_path))
    config_dict = gguf_config_dict(reader)
    config = LlamaConfig(**config_dict)
    config.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config_dict["bos_token_id"],
        eos_token_id=config_dict["eos_token_id"],
        pad_token_id=config_dict["pad_token_id"],
    ).save_pretrained(out_dir)
    save_file(gguf_state_dict(reader, config_dict), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    chat_template = _field(reader, "tokenizer.chat_template")
    del reader  # release the memory map before the tokenizer reads the file again

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
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
