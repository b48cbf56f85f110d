"""Registry, weight-loading checks, platform dtype choice, and the cache-less dummy run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from lm_console.engine.errors import InvalidEngineArgsError, UnsupportedArchitectureError
from lm_console.engine.forward_context import set_forward_context
from lm_console.engine.models.loader import iterate_safetensors, load_model
from lm_console.engine.models.registry import MODEL_REGISTRY, get_model_class
from lm_console.engine.platform import (
    cpu_has_fast_bf16,
    cpuinfo_has_fast_bf16,
    detect_device,
    resolve_dtype,
    torch_device,
    torch_dtype,
)


def test_registry_maps_supported_architectures():
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        assert get_model_class(SimpleNamespace(architectures=[name])) is MODEL_REGISTRY[name]


@pytest.mark.parametrize("architectures", [["GPT2LMHeadModel"], None])
def test_unsupported_architecture_names_supported_ones(architectures):
    with pytest.raises(UnsupportedArchitectureError, match="Qwen3ForCausalLM"):
        get_model_class(SimpleNamespace(architectures=architectures))


def test_load_weights_rejects_missing_and_unknown_tensors(tiny_qwen2_dir):
    config = AutoConfig.from_pretrained(tiny_qwen2_dir)
    weights = dict(iterate_safetensors(tiny_qwen2_dir))
    model_cls = get_model_class(config)
    partial = {k: v for k, v in weights.items() if "layers.1.self_attn.k_proj" not in k}
    with pytest.raises(ValueError, match="k_proj|qkv_proj"):
        model_cls(config, torch.float32).load_weights(partial.items())
    extra = {**weights, "model.layers.0.mystery.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="mystery"):
        model_cls(config, torch.float32).load_weights(extra.items())


def test_bf16_model_loads_and_ties(tiny_llama_dir, tmp_path):
    """The head shares the embedding's tensor exactly when the config ties them (the tiny test
    Llama has its own head; a copy of it with tie_word_embeddings and no lm_head tensor ties)."""
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    assert not config.tie_word_embeddings
    model = load_model(tiny_llama_dir, config, torch.bfloat16, "cpu")
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    tied_dir = tmp_path / "tied"
    tied_dir.mkdir()
    for item in tiny_llama_dir.iterdir():
        if item.name != "model.safetensors":
            (tied_dir / item.name).write_bytes(item.read_bytes())
    weights = {k: v for k, v in load_file(tiny_llama_dir / "model.safetensors").items() if k != "lm_head.weight"}
    save_file(weights, tied_dir / "model.safetensors")
    config.tie_word_embeddings = True
    config.save_pretrained(tied_dir)
    model = load_model(tied_dir, AutoConfig.from_pretrained(tied_dir), torch.bfloat16, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in model.parameters())
    assert not model.training


def test_dummy_run_without_metadata_matches_hf(tiny_qwen3_dir):
    """set_forward_context(None): one causal sequence, no cache (the profiling run)."""
    config = AutoConfig.from_pretrained(tiny_qwen3_dir)
    ours = load_model(tiny_qwen3_dir, config, torch.float32, "cpu")
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32,
                                               attn_implementation="eager")
    ids = torch.arange(100, 130)
    with torch.inference_mode(), set_forward_context(None):
        logits = ours.compute_logits(ours(ids, torch.arange(30)))
        expected = ref(ids[None]).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4 * expected.abs().max().item(), rtol=0)


def test_resolve_dtype(monkeypatch):
    assert resolve_dtype("bf16", "cpu") == "bfloat16"
    assert resolve_dtype("float32", "cpu") == "float32"
    assert resolve_dtype("FP16", "cpu") == "float16"
    assert resolve_dtype(torch.bfloat16, "cpu") == "bfloat16"
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    expected = "bfloat16" if cpu_has_fast_bf16() else "float32"
    assert resolve_dtype("auto", "cpu") == expected
    with pytest.raises(InvalidEngineArgsError, match="bfloat16"):
        resolve_dtype("int8", "cpu")
    with pytest.raises(InvalidEngineArgsError, match="torch.float64"):
        resolve_dtype(torch.float64, "cpu")
    assert detect_device() in ("cpu", "cuda")
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        assert torch_dtype(name) is dtype
    assert torch_device("cpu") == torch.device("cpu")


def test_cpuinfo_flags_decide_fast_bf16():
    assert cpuinfo_has_fast_bf16("processor : 0\nflags : fpu sse avx512f amx_bf16 amx_tile\n")
    assert cpuinfo_has_fast_bf16("flags\t\t: fpu avx512_bf16\n")
    assert not cpuinfo_has_fast_bf16("processor : 0\nflags : fpu sse avx2\n")
    assert not cpuinfo_has_fast_bf16("")
    assert isinstance(cpu_has_fast_bf16(), bool)
