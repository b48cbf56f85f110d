"""The transformers-free Llama config reader agrees with AutoConfig field for field, and hands
every config it does not fully understand to AutoConfig."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lm_console.engine.config.plain_llama_config import PlainLlamaConfig, read_plain_llama_config

_BASE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 300,
}


def _write(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _assert_same_as_autoconfig(model_dir: Path) -> PlainLlamaConfig:
    from transformers import AutoConfig

    plain = read_plain_llama_config(model_dir)
    assert plain is not None
    auto = AutoConfig.from_pretrained(model_dir)
    from lm_console.engine.models.layers import rope_parameters

    for name, value in plain.to_dict().items():
        if name == "rope_parameters":  # transformers 4 keeps rope_theta / rope_scaling instead
            assert rope_parameters(auto) == value
        else:
            assert getattr(auto, name) == value, name
    assert plain.model_type == auto.model_type
    assert plain.get_text_config() is plain
    return plain


def test_embedded_model_config_matches_autoconfig(embedded_model_dir: Path) -> None:
    plain = _assert_same_as_autoconfig(embedded_model_dir)
    assert plain.rope_parameters == {"rope_theta": 100000.0, "rope_type": "default"}
    assert plain.num_key_value_heads == 3 and plain.tie_word_embeddings is True


def test_tiny_llama_config_matches_autoconfig(tiny_llama_dir: Path) -> None:
    _assert_same_as_autoconfig(tiny_llama_dir)


@pytest.mark.parametrize("extra", [
    {},  # every optional field defaulted: head_dim, kv heads, rope theta derived
    {"rope_theta": 500000, "num_key_value_heads": 2, "rms_norm_eps": 1e-5},  # older spelling
    {"rope_parameters": {"rope_theta": 1234.5, "rope_type": "default"}, "head_dim": 32},
    {"rope_scaling": None, "eos_token_id": [2, 7], "pad_token_id": None, "torch_dtype": "bfloat16"},
    {"dtype": "float32", "attention_dropout": 0, "initializer_range": 1.0},  # int dropout: LlamaConfig takes it
])
def test_written_configs_match_autoconfig(tmp_path: Path, extra: dict[str, Any]) -> None:
    _assert_same_as_autoconfig(_write(tmp_path, {**_BASE, **extra}))


@pytest.mark.parametrize("change", [
    {"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}},  # scaled RoPE
    {"rope_scaling": {"type": "linear", "factor": 2.0}},
    {"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
    {"quantization_config": {"quant_method": "gptq"}},  # a key the reader does not know
    {"hidden_size": "64"},  # wrong type
    {"num_attention_heads": 5},  # 64 not divisible: AutoConfig's own error
    {"hidden_act": "gelu"},
    # AutoConfig (LlamaConfig's strict fields) refuses these: the reader must not take them
    {"rms_norm_eps": 0}, {"rms_norm_eps": 1}, {"initializer_range": 5.0}, {"initializer_range": 0},
    {"dtype": "nonsense"}, {"torch_dtype": "float99"},
])
def test_anything_else_goes_to_autoconfig(tmp_path: Path, change: dict[str, Any]) -> None:
    assert read_plain_llama_config(_write(tmp_path, {**_BASE, **change})) is None


def test_scaled_rope_model_loads_through_autoconfig(tiny_llama3_rope_dir: Path) -> None:
    from lm_console.engine.config import load_hf_config

    assert read_plain_llama_config(tiny_llama3_rope_dir) is None
    assert load_hf_config(str(tiny_llama3_rope_dir)).rope_parameters["rope_type"] == "llama3"


def test_missing_config_goes_to_autoconfig(tmp_path: Path) -> None:
    assert read_plain_llama_config(tmp_path) is None


def test_reading_a_plain_llama_imports_no_transformers(embedded_model_dir: Path) -> None:
    code = ("import sys; from lm_console.engine.config import load_hf_config; "
            f"c = load_hf_config({str(embedded_model_dir)!r}); "
            "print(type(c).__name__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["PlainLlamaConfig", "False"]
