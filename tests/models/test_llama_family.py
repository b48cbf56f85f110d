"""Our model code vs HF transformers (float32, eager attention) on the same directories."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lm_console.engine.models.loader import load_model
from paged_model_harness import PagedHarness

TINY_DIRS = ["tiny_llama_dir", "tiny_llama3_rope_dir", "tiny_mistral_dir", "tiny_qwen2_dir",
             "tiny_qwen3_dir"]


def _models(model_dir: Path):
    config = AutoConfig.from_pretrained(model_dir)
    ours = load_model(model_dir, config, torch.float32, torch.device("cpu"))
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    return ours, ref


def _ref_logits(ref, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return ref(torch.tensor([token_ids])).logits[0].float()  # [T, vocab]


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().item()
    torch.testing.assert_close(ours, ref, atol=1e-4 * max(scale, 1.0), rtol=0)


def _check_prefill_chunks_and_decodes(ours, ref, prompt: list[int], num_decodes: int,
                                      split: int) -> None:
    tokens = list(prompt)
    gen = torch.Generator().manual_seed(len(prompt))
    tokens += torch.randint(0, ref.config.vocab_size, (num_decodes,), generator=gen).tolist()
    expected = _ref_logits(ref, tokens)  # [len(prompt) + num_decodes, vocab]

    # One-chunk prefill, then decodes.
    harness = PagedHarness(ours)
    got = [harness.step([("a", prompt)])]
    got += [harness.step([("a", [t])]) for t in tokens[len(prompt):]]
    _assert_close(torch.cat(got), expected)

    # Two-chunk prefill (second chunk attends to cached context), then decodes, batched with a
    # second request whose prefill runs alongside the first one's decodes.
    harness = PagedHarness(ours, seed=1)
    got = [harness.step([("a", prompt[:split])])]
    got.append(harness.step([("a", prompt[split:]), ("b", prompt[:5])])[: len(prompt) - split])
    for t in tokens[len(prompt):]:
        got.append(harness.step([("b", [prompt[5]]), ("a", [t])])[1:])
    _assert_close(torch.cat(got), expected)


def test_negative_control_rank1_attention_zeroed_fails_the_logit_check(tiny_llama_dir):
    """The logit comparison with HF on our model with the attention of its rank-1 heads zeroed
    (tests/broken_variants.py) must fail."""
    from broken_variants import rank1_attention_zeroed

    ours, ref = _models(tiny_llama_dir)
    prompt = torch.randint(0, ref.config.vocab_size, (45,), generator=torch.Generator().manual_seed(0)).tolist()
    with rank1_attention_zeroed(), pytest.raises(AssertionError, match="not close"):
        _check_prefill_chunks_and_decodes(ours, ref, prompt, num_decodes=4, split=19)


@pytest.mark.parametrize("fixture", TINY_DIRS)
def test_tiny_models_match_hf(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    ours, ref = _models(model_dir)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, ref.config.vocab_size, (45,), generator=gen).tolist()
    _check_prefill_chunks_and_decodes(ours, ref, prompt, num_decodes=4, split=19)


def test_long_sequence_crosses_llama3_bands_and_window(tiny_llama3_rope_dir, tiny_mistral_dir):
    """Positions past original_max_position_embeddings (llama3) and past the window (mistral)."""
    gen = torch.Generator().manual_seed(1)
    for model_dir in (tiny_llama3_rope_dir, tiny_mistral_dir):
        ours, ref = _models(model_dir)
        prompt = torch.randint(0, ref.config.vocab_size, (150,), generator=gen).tolist()
        _check_prefill_chunks_and_decodes(ours, ref, prompt, num_decodes=2, split=70)


@pytest.mark.slow
def test_embedded_model_matches_hf(embedded_model_dir):
    ours, ref = _models(embedded_model_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )
    assert isinstance(prompt, list) and prompt
    _check_prefill_chunks_and_decodes(ours, ref, list(prompt), num_decodes=3, split=17)
