"""Write a tiny HF model directory as a GGUF file, the way llama.cpp's convert_hf_to_gguf.py does.

Independent of the engine's reader on purpose: tensor names come from the `gguf` package's own
TensorNameMap, metadata through GGUFWriter's add_* helpers, and the storage conventions are the
converter's (llama: q/k rows permuted for interleaved rope and llama3 scaling as a rope_freqs
tensor; gemma3: norm weights stored as 1 + w, global rope base in rope.freq_base, local one in
rope.freq_base_swa). The tokenizer is SmolLM2's byte-level BPE cut to the tiny
model's vocabulary size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

# 2-D weight types by HF name fragment (first match); the rest of the 2-D weights use `default`.
MIXED_TYPES = {"embed_tokens": "Q8_0", "q_proj": "Q4_0", "k_proj": "Q4_1", "down_proj": "Q4_0",
               "lm_head": "Q8_0"}


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: rotate-halves rows -> interleaved pairs per head."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _llama3_rope_freqs(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: the per-frequency divisors of llama3 scaling."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / head_dim))
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def small_vocabulary(num_tokens: int) -> dict[str, Any]:
    """SmolLM2's byte-level BPE cut to its first num_tokens tokens (and the merges among them),
    as GGUF tokenizer metadata: a real tokenizer that converts in well under a second."""
    from lm_console.engine.models.embedded import resolve_model_path

    model_dir = resolve_model_path(None)
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    tokens = [by_id[i] for i in range(num_tokens)]
    kept = set(tokens)
    merges = [" ".join(m) for m in (tuple(m.split(" ")) if isinstance(m, str) else m
                                    for m in spec["model"]["merges"])
              if m[0] in kept and m[1] in kept and m[0] + m[1] in kept]
    special = {a["content"] for a in spec["added_tokens"] if a["special"]}
    gen = json.loads((model_dir / "generation_config.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    return {"tokens": tokens, "token_types": [3 if t in special else 1 for t in tokens],
            "merges": merges, "bos": gen["bos_token_id"], "eos": gen["eos_token_id"],
            "pad": gen.get("pad_token_id", gen["eos_token_id"]), "chat_template": tok_config["chat_template"]}


def _add_tokenizer(writer: Any, vocab: dict[str, Any]) -> None:
    """The tokenizer.* keys llama.cpp's _set_vocab_gpt2 writes."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["token_types"])
    writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(vocab["bos"])
    writer.add_eos_token_id(vocab["eos"])
    writer.add_pad_token_id(vocab["pad"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(vocab["chat_template"])


def write_gguf(hf_dir: Path, path: Path, arch: str, vocab: dict[str, Any], default_type: str = "F32",
               types: dict[str, str] | None = None, skip_keys: tuple[str, ...] = ()) -> Path:
    """Write the model in hf_dir as `arch` GGUF at path; 2-D weights as `types` / default_type.

    vocab: small_vocabulary(n) with n the model's vocab_size.
    skip_keys: metadata keys (without the "{arch}." prefix) left out, to test missing keys."""
    import gguf
    import torch
    from gguf.quants import quantize
    from safetensors.torch import load_file

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    state = load_file(str(Path(hf_dir) / "model.safetensors"))
    text = config.get("text_config", config)
    layers, heads = text["num_hidden_layers"], text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads", heads)
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    rope = text.get("rope_parameters") or {}
    if arch == "gemma3":
        global_rope, local_rope = rope["full_attention"], rope["sliding_attention"]
    else:
        global_rope, local_rope = rope, None

    writer = gguf.GGUFWriter(str(path), arch)
    skipped = {f"{arch}.{k}" for k in skip_keys}
    real_add_key_value = writer.add_key_value

    def add_key_value(key: str, *args: Any, **kwargs: Any) -> None:
        if key not in skipped:
            real_add_key_value(key, *args, **kwargs)

    writer.add_key_value = add_key_value  # type: ignore[method-assign]
    writer.add_block_count(layers)
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(text["rms_norm_eps"])
    writer.add_rope_freq_base(global_rope.get("rope_theta", 10000.0))
    if "head_dim" in text:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_vocab_size(text["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    if global_rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(global_rope["factor"])
    if arch == "gemma3":
        writer.add_rope_freq_base_swa(local_rope["rope_theta"])
        writer.add_sliding_window(text["sliding_window"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(writer, vocab)

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    if global_rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(global_rope, head_dim))
    for hf_name, tensor in state.items():
        if arch == "gemma3" and hf_name == "lm_head.weight":
            continue  # tied: Gemma files carry the embedding only
        array = tensor.to(torch.float32).numpy()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            array = _permute(array, heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            array = _permute(array, kv_heads)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            array = array + np.float32(1.0)
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        type_name = "F32"
        if array.ndim == 2:
            type_name = next((t for frag, t in (types or {}).items() if frag in hf_name), default_type)
        qtype = gguf.GGMLQuantizationType[type_name]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        else:
            writer.add_tensor(name, quantize(np.ascontiguousarray(array), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
