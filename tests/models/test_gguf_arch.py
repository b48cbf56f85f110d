"""GGUF metadata -> HF config (lm_console/engine/models/gguf_arch.py) on metadata-only files: fast cases
the tiny-model tests do not reach (llama3 rope of real releases, gemma3 variants)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from lm_console.engine.errors import InvalidGGUFError, UnsupportedArchitectureError  # noqa: E402
from lm_console.engine.models.gguf_arch import (  # noqa: E402
    ARCHITECTURES, gguf_config_dict, hf_tensor_name, llama3_rope_factors, llama3_rope_from_freqs,
)

BASE = {"block_count": 6, "context_length": 4096, "embedding_length": 64, "feed_forward_length": 128,
        "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 16,
        "attention.value_length": 16, "attention.layer_norm_rms_epsilon": 1e-6}


def _config(tmp_path: Path, arch: str, keys: dict, tensors: dict | None = None) -> dict:
    """gguf_config_dict of a file with these {arch}.* keys and (besides token_embd) tensors."""
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        name = f"{arch}.{key}"
        if isinstance(value, str):
            writer.add_string(name, value)
        elif isinstance(value, list):
            writer.add_array(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        else:
            writer.add_float32(name, value)
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_config_dict(gguf.GGUFReader(str(path)))


@pytest.mark.parametrize("params", [
    # llama 3.1 / 3.2 as released (head_dim 128, theta 500000), and a band with four blended
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0, "original_max_position_embeddings": 4096},
])
def test_llama3_rope_is_rebuilt_from_rope_freqs(params):
    freqs = llama3_rope_factors(params, 500000.0, 128).astype(np.float32)  # as the file holds them
    assert ((freqs > 1) & (freqs < params["factor"])).sum() >= 2
    assert llama3_rope_from_freqs(freqs.astype(np.float64), 500000.0, 128) == {"rope_type": "llama3", **params}


def test_llama3_rope_without_blended_frequencies_reproduces_the_tensor():
    """No frequency in the band (head_dim 16): any band inside the gap gives the same rope."""
    params = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 1.2, "original_max_position_embeddings": 1000}
    freqs = llama3_rope_factors(params, 10000.0, 16)
    assert set(freqs.tolist()) == {1.0, 8.0}
    rebuilt = llama3_rope_from_freqs(freqs, 10000.0, 16)
    np.testing.assert_array_equal(llama3_rope_factors(rebuilt, 10000.0, 16), freqs)
    assert llama3_rope_from_freqs(np.ones(8), 10000.0, 16) is None


def test_rope_freqs_that_are_not_llama3_are_refused(tmp_path):
    freqs = np.linspace(1, 4, 8, dtype=np.float32)[::-1].copy()  # decreasing: no llama3 band does that
    with pytest.raises(UnsupportedArchitectureError, match="do not follow llama3"):
        _config(tmp_path, "llama", BASE, {"rope_freqs.weight": freqs})
    with pytest.raises(UnsupportedArchitectureError, match="rope_freqs in a qwen2 file"):
        _config(tmp_path, "qwen2", BASE, {"rope_freqs.weight": np.ones(8, dtype=np.float32)})


def test_gemma3_defaults_are_llama_cpp_s(tmp_path):
    """No pattern / local base / scale keys: 5 sliding in 6, local base 10000, scale 1/sqrt(head_dim);
    linear scaling applies to the global layers only."""
    config = _config(tmp_path, "gemma3", {**BASE, "attention.sliding_window": 512, "rope.freq_base": 1e6,
                                          "rope.scaling.type": "linear", "rope.scaling.factor": 8.0})
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["sliding_window"] == 512 and config["query_pre_attn_scalar"] == 16
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1e6, 10000.0)
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 32
    assert config["hidden_activation"] == "gelu_pytorch_tanh"


def test_gemma3_explicit_pattern_base_and_scale(tmp_path):
    keys = {**BASE, "attention.sliding_window": 128, "rope.freq_base_swa": 20000.0,
            "attention.sliding_window_pattern": [True, False] * 3, "attention.scale": 0.125,
            "final_logit_softcapping": 30.0}
    config = _config(tmp_path, "gemma3", keys)
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 3
    assert config["rope_local_base_freq"] == 20000.0
    assert config["query_pre_attn_scalar"] == 64.0 and config["final_logit_softcapping"] == 30.0
    no_window = _config(tmp_path, "gemma3", BASE)
    assert no_window["layer_types"] == ["full_attention"] * 6 and no_window["sliding_window"] is None


def test_missing_and_inconsistent_keys_are_named(tmp_path):
    with pytest.raises(InvalidGGUFError, match=r"no gemma3\.attention\.layer_norm_rms_epsilon key"):
        _config(tmp_path, "gemma3", {k: v for k, v in BASE.items() if "epsilon" not in k})
    with pytest.raises(UnsupportedArchitectureError, match="key_length 16 != value_length 32"):
        _config(tmp_path, "qwen3", {**BASE, "attention.value_length": 32})
    with pytest.raises(InvalidGGUFError, match="sliding_window_pattern has 2 entries for 6 layers"):
        _config(tmp_path, "gemma3", {**BASE, "attention.sliding_window": 8,
                                     "attention.sliding_window_pattern": [True, False]})


def test_tensor_names_follow_each_architecture():
    assert hf_tensor_name("blk.3.ffn_norm.weight", ARCHITECTURES["llama"]) == \
        "model.layers.3.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.3.ffn_norm.weight", ARCHITECTURES["gemma3"]) == \
        "model.layers.3.pre_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.0.attn_q.bias", ARCHITECTURES["qwen2"]) == "model.layers.0.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.attn_k_norm.weight", ARCHITECTURES["qwen3"]) == \
        "model.layers.0.self_attn.k_norm.weight"
    with pytest.raises(UnsupportedArchitectureError, match="'blk.0.attn_q_norm.weight' is not supported for qwen2"):
        hf_tensor_name("blk.0.attn_q_norm.weight", ARCHITECTURES["qwen2"])
