"""A transformers-free reader for plain Llama config.json files: the cold start's config.

transformers' LlamaConfig module costs about 0.7 s to import on this project's CPUs (its field
validators import transformers.activations, which pulls in torch.distributed.tensor), a quarter
of `lmc generate`'s whole cold start. A config.json that names LlamaForCausalLM and holds only the
keys listed here (every field of LlamaConfig plus the generic ones transformers writes) is read
here instead, with LlamaConfig's own defaults; anything else (another architecture, RoPE scaling,
an unknown key, a value of the wrong type) returns None and goes through AutoConfig as before.
tests/config/test_plain_llama_config.py checks every field against AutoConfig.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# LlamaConfig's fields and defaults (transformers 5); head_dim and num_key_value_heads are
# derived when None, as LlamaConfig.__post_init__ does.
_LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "use_cache": True,
    "pad_token_id": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "head_dim": None,
}
_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "max_position_embeddings")
_OPTIONAL_INT_FIELDS = ("num_key_value_heads", "head_dim", "pad_token_id", "bos_token_id", "pretraining_tp")
_BOOL_FIELDS = ("use_cache", "tie_word_embeddings", "attention_bias", "mlp_bias")
_FLOAT_FIELDS = ("initializer_range", "rms_norm_eps", "attention_dropout")
# LlamaConfig (@strict) refuses an int for these two (attention_dropout takes either), and an
# initializer_range outside [0, 1].
_STRICT_FLOAT_FIELDS = ("initializer_range", "rms_norm_eps")
# dtype names AutoConfig resolves (it refuses a name torch lacks); anything else goes to it.
_DTYPE_NAMES = {None, "float32", "float16", "bfloat16", "float64"}
# Keys transformers writes that change nothing the engine reads.
_BOOKKEEPING_KEYS = {"architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
                     "_name_or_path"}
_DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


class PlainLlamaConfig:
    """The attributes of transformers' LlamaConfig for a plain Llama config.json (read-only use).

    Duck-types what the engine reads from an HF config: the fields, `architectures`,
    `model_type`, `rope_parameters` and `get_text_config()`.
    """

    model_type = "llama"

    def __init__(self, fields: dict[str, Any]) -> None:
        self.__dict__.update(fields)

    def get_text_config(self, *args: Any, **kwargs: Any) -> PlainLlamaConfig:
        """The language model's config: this one (a Llama is text only)."""
        return self

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (a copy)."""
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"PlainLlamaConfig({json.dumps(self.__dict__, sort_keys=True)})"


def read_plain_llama_config(model_dir: str | Path) -> PlainLlamaConfig | None:
    """model_dir's config as a PlainLlamaConfig, or None when AutoConfig must read it."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # AutoConfig raises its own error for a missing or broken file
    if not isinstance(raw, dict) or raw.get("model_type") != "llama" \
            or raw.get("architectures") != ["LlamaForCausalLM"]:
        return None
    if set(raw) - set(_LLAMA_DEFAULTS) - _BOOKKEEPING_KEYS - {"rope_parameters", "rope_theta", "rope_scaling"}:
        return None
    if raw.get("dtype") not in _DTYPE_NAMES or raw.get("torch_dtype") not in _DTYPE_NAMES:
        return None
    rope = _plain_rope_parameters(raw)
    if rope is None:
        return None
    fields = {**_LLAMA_DEFAULTS, **{k: v for k, v in raw.items() if k in _LLAMA_DEFAULTS}}
    if not _types_ok(fields):
        return None
    if fields["num_attention_heads"] <= 0 or fields["hidden_size"] % fields["num_attention_heads"]:
        return None  # LlamaConfig refuses it; AutoConfig says why
    if fields["head_dim"] is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    for name in _FLOAT_FIELDS:
        fields[name] = float(fields[name])
    fields["architectures"] = ["LlamaForCausalLM"]
    fields["rope_parameters"] = rope
    return PlainLlamaConfig(fields)


def _plain_rope_parameters(raw: dict[str, Any]) -> dict[str, Any] | None:
    """{"rope_theta", "rope_type": "default"} for unscaled RoPE in either spelling; None otherwise."""
    if raw.get("rope_scaling") is not None:
        return None
    params = raw.get("rope_parameters")
    if params is None:
        theta = raw.get("rope_theta", _DEFAULT_ROPE_THETA)
    elif isinstance(params, dict) and set(params) <= {"rope_theta", "rope_type"} \
            and params.get("rope_type", "default") == "default" and "rope_theta" not in raw:
        theta = params.get("rope_theta", _DEFAULT_ROPE_THETA)
    else:
        return None
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        return None
    return {"rope_theta": float(theta), "rope_type": "default"}


def _types_ok(fields: dict[str, Any]) -> bool:
    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    eos = fields["eos_token_id"]
    return (all(is_int(fields[k]) for k in _INT_FIELDS)
            and all(fields[k] is None or is_int(fields[k]) for k in _OPTIONAL_INT_FIELDS)
            and all(isinstance(fields[k], bool) for k in _BOOL_FIELDS)
            and all(is_int(fields[k]) or isinstance(fields[k], float) for k in _FLOAT_FIELDS)
            and all(isinstance(fields[k], float) for k in _STRICT_FLOAT_FIELDS)
            and 0.0 <= fields["initializer_range"] <= 1.0
            and (eos is None or is_int(eos) or (isinstance(eos, list) and all(map(is_int, eos))))
            and fields["hidden_act"] == "silu")
