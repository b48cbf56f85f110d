"""Reference outputs of transformers' Gemma3ForConditionalGeneration and the comparison the
Gemma3 VLM tests share."""

from __future__ import annotations

import pytest
import torch


def hf_greedy(hf_model, hf_processor, text, images, max_tokens):
    """(prompt ids, greedy token ids, their log-probabilities) from transformers' generate."""
    inputs = hf_processor(text=[text], images=[images], return_tensors="pt")
    with torch.inference_mode():
        out = hf_model.generate(**inputs, do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]  # [vocab] per step
    return inputs["input_ids"][0].tolist(), tokens, logprobs


def assert_matches_hf(output, expected) -> None:
    """Same prompt ids, same greedy tokens, and the top-5 log-probabilities within fp32 noise:
    the tiny random model is so peaked that greedy tokens (and the top logprob, ~0) are too
    coarse to see the image-attention mask; the runners-up are not."""
    prompt_ids, tokens, logprobs = expected
    assert output.prompt_token_ids == prompt_ids
    assert output.outputs[0].token_ids == tokens
    for entry, reference in zip(output.outputs[0].logprobs, logprobs, strict=True):
        ids = sorted(entry)
        ours = [entry[t].logprob for t in ids]
        assert ours == pytest.approx(reference[ids].tolist(), rel=1e-4, abs=1e-3)
