"""What a GGUF file of each architecture we load means in Hugging Face terms.

For llama, qwen2, qwen3 and gemma3 this module knows, as llama.cpp's convert_hf_to_gguf.py writes
them: the tensor names (blk.N.attn_q -> model.layers.N.self_attn.q_proj), the metadata keys that
become config.json fields, and each architecture's storage conventions:

- llama: q/k rows interleaved for llama.cpp's rope (un-permuted on load); llama3 rope scaling
  stored as a `rope_freqs` tensor of per-frequency divisors (turned back into HF's llama3
  parameters, checked against the tensor);
- qwen2: no permutation, q/k/v biases; qwen3: no permutation, per-head q/k norms, key_length;
- gemma3: every norm weight stored as 1 + w (Gemma's RMSNorm scales by 1 + w, llama.cpp's by w),
  sliding-window layers 5 in 6 unless the file says otherwise, local rope base 10000 unless
  `rope.freq_base_swa` says otherwise, query scale head_dim ** -0.5 (hidden / heads on the
  62-layer 27B, as llama.cpp), the sqrt(hidden) embedding scale applied by the model (not stored).

Anything else (another architecture, a rope scaling we do not implement, a missing key) raises a
specific error naming it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lm_console.engine.errors import InvalidGGUFError, UnsupportedArchitectureError

# GGUF layer tensor -> HF module path under model.layers.N (the parts every architecture shares).
_DECODER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True, slots=True)
class GGUFArchitecture:
    """One GGUF architecture's HF class, tensor names and storage conventions."""

    name: str  # general.architecture
    hf_architecture: str  # config.architectures[0]
    model_type: str  # config.model_type
    layer_names: Mapping[str, str]  # GGUF layer tensor -> HF module path in the layer
    permuted_qk: bool  # llama.cpp's converter interleaved the rope halves of q/k rows
    norm_shift: float  # added to every norm weight by the converter (Gemma stores 1 + w)
    # transformers' tokenizer class for model_type assumes a sentencepiece vocabulary (Gemma's)
    sentencepiece_class: bool = False


ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("llama", "LlamaForCausalLM", "llama",
                              {**_DECODER_LAYER, "ffn_norm": "post_attention_layernorm"}, True, 0.0),
    "qwen2": GGUFArchitecture("qwen2", "Qwen2ForCausalLM", "qwen2",
                              {**_DECODER_LAYER, "ffn_norm": "post_attention_layernorm"}, False, 0.0),
    "qwen3": GGUFArchitecture("qwen3", "Qwen3ForCausalLM", "qwen3",
                              {**_DECODER_LAYER, **_QK_NORM, "ffn_norm": "post_attention_layernorm"},
                              False, 0.0),
    "gemma3": GGUFArchitecture("gemma3", "Gemma3ForCausalLM", "gemma3_text", {
        **_DECODER_LAYER, **_QK_NORM,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }, False, 1.0, sentencepiece_class=True),
}
SUPPORTED_GGUF_ARCHITECTURES = tuple(ARCHITECTURES)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_architecture(reader: Any) -> GGUFArchitecture:
    """The file's architecture; raises naming it and the supported ones if we do not load it."""
    name = _field(reader, "general.architecture")
    if name is None:
        raise InvalidGGUFError("the GGUF file has no general.architecture key")
    if name not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {name!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def hf_tensor_name(gguf_name: str, arch: GGUFArchitecture) -> str:
    """HF checkpoint name of a GGUF tensor name of the architecture."""
    match = _LAYER_RE.fullmatch(gguf_name)
    if match:
        layer, part, kind = match.groups()
        if part in arch.layer_names:
            return f"model.layers.{layer}.{arch.layer_names[part]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise UnsupportedArchitectureError(f"GGUF tensor {gguf_name!r} is not supported for {arch.name} files")


def is_norm(hf_name: str) -> bool:
    """Whether a checkpoint tensor is an RMSNorm weight (Gemma files store those shifted)."""
    return hf_name.endswith("norm.weight")


def permuted_rope_heads(hf_name: str, arch: GGUFArchitecture, heads: int, kv_heads: int) -> int | None:
    """The head count to un-permute a checkpoint tensor's rows by (q_proj: heads, k_proj:
    kv_heads) in a file whose converter interleaved them (llama); None for any other tensor."""
    if not arch.permuted_qk:
        return None
    if hf_name.endswith("self_attn.q_proj.weight"):
        return heads
    if hf_name.endswith("self_attn.k_proj.weight"):
        return kv_heads
    return None


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-rope row order for a q/k projection [heads*D, in]."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


class _Meta:
    """`{arch}.*` metadata getters: `need` raises InvalidGGUFError naming a missing key."""

    def __init__(self, reader: Any, arch: GGUFArchitecture) -> None:
        self.reader, self.arch = reader, arch

    def get(self, key: str, default: Any = None) -> Any:
        return _field(self.reader, f"{self.arch.name}.{key}", default)

    def number(self, key: str, default: float | None = None, needed: bool = False) -> float | None:
        """A float32 key as the shortest decimal that is that float32 (1e-06, not 9.99999997e-07)."""
        value = self.need(key) if needed else self.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):  # e.g. a string "1e-6"
            raise InvalidGGUFError(f"{self.arch.name}.{key} is {value!r:.80}, not a number")
        return float(str(np.float32(value)))

    def integer(self, key: str, default: int | None = None, needed: bool = False) -> int:
        """An integer key (a string, float or list is refused naming the key)."""
        value = self.need(key) if needed else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidGGUFError(f"{self.arch.name}.{key} is {value!r:.80}, not an integer")
        return value

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise InvalidGGUFError(f"the {self.arch.name} GGUF file has no {self.arch.name}.{key} key, "
                                   "which its architecture needs")
        return value


def _tensor_shapes(reader: Any) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape in torch order (GGUF lists dims innermost first)."""
    return {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}


def gguf_config_dict(reader: Any) -> dict[str, Any]:
    """config.json fields (for transformers' config class of the architecture) from the metadata."""
    arch = gguf_architecture(reader)
    meta = _Meta(reader, arch)
    shapes = _tensor_shapes(reader)
    if "token_embd.weight" not in shapes:
        raise InvalidGGUFError("the GGUF file has no token_embd.weight tensor")
    hidden = meta.integer("embedding_length", needed=True)
    num_heads = meta.integer("attention.head_count", needed=True)
    if num_heads < 1:  # the head size below divides by it
        raise InvalidGGUFError(f"{arch.name}.attention.head_count is {num_heads}; it must be >= 1")
    config: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        # The embedding's rows: llama.cpp drops a padded vocabulary's unused rows (gemma3).
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": meta.integer("feed_forward_length", needed=True),
        "num_hidden_layers": meta.integer("block_count", needed=True),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta.integer("attention.head_count_kv", num_heads),
        "head_dim": meta.integer("attention.key_length", hidden // num_heads),
        "max_position_embeddings": meta.integer("context_length", needed=True),
        "rms_norm_eps": meta.number("attention.layer_norm_rms_epsilon", needed=True),
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    value_length = meta.get("attention.value_length")
    if value_length is not None and meta.integer("attention.value_length") != config["head_dim"]:
        raise UnsupportedArchitectureError(
            f"GGUF key_length {config['head_dim']} != value_length {value_length} is not supported")
    rope_theta = meta.number("rope.freq_base", 10000.0)
    scaling = _rope_scaling(reader, meta, rope_theta, config["head_dim"])
    if arch.name == "gemma3":
        config.update(_gemma3_fields(meta, config, rope_theta, scaling))
        return config
    config["hidden_act"] = "silu"
    config["rope_theta"] = rope_theta
    if scaling is not None:
        config["rope_scaling"] = scaling
    if arch.name == "qwen3":
        config["attention_bias"] = "blk.0.attn_q.bias" in shapes
    return config


# Control tokens that end a chat turn (llama.cpp also stops on these, whatever the eos id says).
_END_OF_TURN = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>")


def end_of_generation_ids(reader: Any) -> list[int]:
    """eos first, then the file's eot / eom ids and its end-of-turn control tokens (Gemma's
    <end_of_turn> is not its eos): generation_config.json's eos_token_id list."""
    ids = [_field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    tokens, types = reader.fields.get("tokenizer.ggml.tokens"), reader.fields.get("tokenizer.ggml.token_type")
    if tokens is not None and types is not None:
        control = np.flatnonzero(np.asarray(types.contents()) == 3)  # 3: CONTROL
        ids += [int(i) for i in control
                if bytes(tokens.parts[tokens.data[i]]).decode("utf-8", "replace") in _END_OF_TURN]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _rope_scaling(reader: Any, meta: _Meta, theta: float, head_dim: int) -> dict[str, Any] | None:
    """HF rope_scaling from rope.scaling.* keys or a llama3 `rope_freqs` tensor; None if none."""
    kind = meta.get("rope.scaling.type")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        if meta.arch.name != "llama" or kind not in (None, "none"):
            raise UnsupportedArchitectureError(
                f"GGUF rope_freqs in a {meta.arch.name} file with rope scaling {kind!r} is not supported")
        return llama3_rope_from_freqs(np.asarray(freqs.data, dtype=np.float64), theta, head_dim)
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise UnsupportedArchitectureError(
            f"GGUF rope scaling {kind!r} is not supported; supported: none, linear, llama3 rope_freqs")
    return {"rope_type": "linear", "factor": meta.number("rope.scaling.factor", needed=True)}


def llama3_rope_factors(params: Mapping[str, float], theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors [head_dim // 2] llama3 rope scaling applies (as rope_freqs)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    smooth = (original / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blended))


def llama3_rope_from_freqs(freqs: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """HF llama3 rope_scaling that reproduces a file's rope_freqs tensor (checked, else raises).

    The tensor keeps 1 for short wavelengths, `factor` for long ones and a blend between, where
    the blend weight is linear in 1 / wavelength: two or more blended frequencies fix it (up to a
    common scale of original_max_position_embeddings, low and high that changes nothing; low = 1
    as every llama3 release). With fewer, high / low = 4 (llama 3.1 / 3.2) is assumed, and the
    result is checked against the tensor either way. None for a tensor of ones (no scaling)."""
    if freqs.shape != (head_dim // 2,):
        raise InvalidGGUFError(f"GGUF rope_freqs has shape {freqs.shape}, expected ({head_dim // 2},)")
    factor = float(str(np.float32(freqs.max())))  # as written: 8.0, not 8.0000001
    if factor <= 1 + 1e-6 and freqs.min() >= 1 - 1e-6:
        return None  # all ones: no scaling
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = inv_freq / (2 * math.pi)  # 1 / wavelength
    band = (freqs > 1 + 1e-6) & (freqs < factor * (1 - 1e-6))
    weight = (1 / freqs[band] - 1 / factor) / (1 - 1 / factor)  # the blend: a * x + b
    if band.sum() >= 2:
        a, b = np.polyfit(x[band], weight, 1)
        high = 1 - 1 / b  # from b = -low / (high - low) with low = 1
        original = a * (high - 1)
    else:
        high = 4.0
        if band.sum() == 1:
            original = (weight[0] + 1 / 3) * 3 / x[band][0]
        else:  # no blended frequency: put the band between the kept and the slowed wavelengths
            wavelen = 1 / x
            kept = wavelen[freqs <= 1 + 1e-6].max(initial=wavelen.min() / 2)
            slowed = wavelen[freqs >= factor * (1 - 1e-6)].min(initial=wavelen.max() * 2)
            original = math.sqrt(kept * slowed)  # < every slowed wavelength (low = 1)
            high = math.sqrt(original / kept)  # original / high > every kept wavelength
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
              "high_freq_factor": float(high), "original_max_position_embeddings": float(original)}
    if not (original > 0 and high > 1 and factor >= 1 and _reproduces(params, freqs, theta, head_dim)):
        raise UnsupportedArchitectureError("GGUF rope_freqs do not follow llama3 rope scaling; "
                                           "supported: llama3 rope_freqs, linear rope scaling")
    # The fit's 3.99999997 / 8191.9998 are the release's 4 / 8192: keep the round values when
    # they reproduce the tensor as well (an int original_max_position_embeddings, as HF configs).
    rounded = {**params, "high_freq_factor": float(f"{high:.6g}"),
               "original_max_position_embeddings": round(original)}
    return rounded if _reproduces(rounded, freqs, theta, head_dim) else params


def _reproduces(params: Mapping[str, Any], freqs: np.ndarray, theta: float, head_dim: int) -> bool:
    return bool(np.allclose(llama3_rope_factors(params, theta, head_dim), freqs, rtol=1e-4))


def _gemma3_fields(meta: _Meta, config: dict[str, Any], rope_theta: float,
                   scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Gemma3 text fields: attention pattern and window, per-type rope, query scale, soft-cap."""
    layers = config["num_hidden_layers"]
    window = meta.get("attention.sliding_window")
    pattern = meta.get("attention.sliding_window_pattern")
    if window is None:  # no sliding layers (a converter writes none for sliding_window_pattern 1)
        sliding = [False] * layers
    elif isinstance(pattern, list):  # per layer: true = sliding window
        if len(pattern) != layers:
            raise InvalidGGUFError(f"gemma3.attention.sliding_window_pattern has {len(pattern)} "
                                   f"entries for {layers} layers")
        sliding = [bool(p) for p in pattern]
    else:  # every pattern-th layer is global (llama.cpp's gemma3 default: 6)
        every = int(pattern or 6)
        sliding = [(i + 1) % every != 0 for i in range(layers)]
    scale = meta.number("attention.scale")
    if scale is not None:
        query_scalar = scale ** -2
    elif layers == 62:  # gemma-3-27b: scaled by hidden / heads, not head_dim (as llama.cpp)
        query_scalar = config["hidden_size"] / config["num_attention_heads"]
    else:
        query_scalar = config["head_dim"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(window) if window is not None else None,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        # transformers' legacy spelling (read by 4.x and 5.x): rope_scaling is the global layers'.
        "rope_theta": rope_theta,
        "rope_local_base_freq": meta.number("rope.freq_base_swa", 10000.0),
        "rope_scaling": scaling,
        "query_pre_attn_scalar": query_scalar,
        "final_logit_softcapping": meta.number("final_logit_softcapping"),
        "attn_logit_softcapping": None,
    }
