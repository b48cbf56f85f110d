"""Gemma3 text model vs transformers (float32, eager attention) through the paged harness."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lm_console.engine.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from lm_console.engine.models.loader import load_model
from model_factory import make_tiny_model_dir
from test_llama_family import _assert_close, _check_prefill_chunks_and_decodes, _models


def test_gemma3_matches_hf_across_the_window(tiny_gemma3_dir):
    """Prompts longer than the window, chunked prefill and decodes: same logits as HF."""
    ours, ref = _models(tiny_gemma3_dir)
    assert isinstance(ours, Gemma3ForCausalLM)
    windows = [layer.self_attn.attn.sliding_window for layer in ours.model.layers]
    assert windows == [24, 24, 24, 24, 24, None]
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, ref.config.vocab_size, (90,), generator=gen).tolist()
    _check_prefill_chunks_and_decodes(ours, ref, prompt, num_decodes=5, split=37)


@pytest.fixture(scope="module")
def gemma3_variant_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An explicit layer_types list (2 global of 8), window 20, final logit soft-capping, and
    linear RoPE scaling on the global layers (as in gemma-3-4b and larger)."""
    types = ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"]
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("tiny_gemma3_variant"), "gemma3", seed=6, num_hidden_layers=8,
        tie_word_embeddings=True,  # the tied head stays covered here (logits compared, not greedy)
        layer_types=types, sliding_window=20, final_logit_softcapping=30.0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )


def test_gemma3_variant_matches_hf(gemma3_variant_dir):
    ours, ref = _models(gemma3_variant_dir)
    assert ours.final_logit_softcapping == 30.0
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, ref.config.vocab_size, (70,), generator=gen).tolist()
    _check_prefill_chunks_and_decodes(ours, ref, prompt, num_decodes=3, split=41)


def test_gemma3_vlm_checkpoint_serves_its_language_model(tmp_path, tiny_gemma3_dir):
    """Gemma3ForConditionalGeneration: text_config nested, `model.language_model.*` weights."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration as HFGemma3VLM

    text_config = AutoConfig.from_pretrained(tiny_gemma3_dir)
    vision_config = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 32, "patch_size": 8}
    config = Gemma3Config(text_config=text_config.to_dict(), vision_config=vision_config,
                          mm_tokens_per_image=4, image_token_index=text_config.vocab_size - 1,
                          boi_token_index=text_config.vocab_size - 2, eoi_token_index=text_config.vocab_size - 3)
    ref = HFGemma3VLM(config).eval()
    # The text weights of the tiny text model; the vision tower keeps its random init.
    text_ref = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)
    ref.model.language_model.load_state_dict(text_ref.model.state_dict())
    ref.save_pretrained(tmp_path)
    ref = HFGemma3VLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()

    hf_config = AutoConfig.from_pretrained(tmp_path)
    ours = load_model(tmp_path, hf_config, torch.float32, torch.device("cpu"))
    assert isinstance(ours, Gemma3ForConditionalGeneration)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, text_config.vocab_size - 3, (40,), generator=gen).tolist()
    from lm_console.engine.forward_context import set_forward_context

    with torch.inference_mode(), set_forward_context(None):
        got = ours.compute_logits(ours(torch.tensor(prompt), torch.arange(len(prompt))))
        expected = ref(input_ids=torch.tensor([prompt])).logits[0].float()
    _assert_close(got, expected)
