"""Idefics3 / SmolVLM: our vision tower, prompt expansion and greedy decoding equal transformers'."""

from __future__ import annotations

import pytest
import torch

from lm_console.engine import SamplingParams
from mm_factory import make_image

pytestmark = pytest.mark.slow

PROMPTS = [
    ("<image>What is in this image?", [make_image(1)]),
    ("Compare <image> with <image> please.", [make_image(2, 40, 40), make_image(3, 70, 30)]),
    ("A tall one: <image>", [make_image(4, 24, 60)]),
]


@pytest.fixture(scope="module")
def hf_model(tiny_idefics3_dir):
    from transformers import Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(tiny_idefics3_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def hf_processor(tiny_idefics3_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_idefics3_dir)


def test_vision_tower_and_connector_match_hf(tiny_idefics3_dir, hf_model, hf_processor) -> None:
    from transformers import AutoConfig

    from lm_console.engine.models.loader import load_model

    ours = load_model(tiny_idefics3_dir, AutoConfig.from_pretrained(tiny_idefics3_dir), torch.float32, "cpu")
    images = [make_image(1), make_image(3, 70, 30)]
    out = hf_processor(text=["<image><image>"], images=[images], return_tensors="pt")
    with torch.inference_mode():
        reference = hf_model.model.get_image_features(out["pixel_values"], out["pixel_attention_mask"],
                                                      return_dict=True).pooler_output
        # Our batching is per item: each image's tiles, concatenated into one encoder batch.
        tiles = [hf_processor(text=["<image>"], images=[[image]], return_tensors="pt") for image in images]
        mine = ours.embed_multimodal(pixel_values=[t["pixel_values"][0] for t in tiles],
                                     pixel_attention_mask=[t["pixel_attention_mask"][0] for t in tiles])
    reference_all = torch.cat(list(reference))
    assert torch.cat(mine).shape == reference_all.shape == (20 + 12, 64)  # 2x2+1 and 2x1+1 tiles, 4 each
    torch.testing.assert_close(torch.cat(mine), reference_all, atol=1e-5, rtol=1e-5)


def test_prompt_expansion_equals_hf_processor(tiny_idefics3_dir, hf_processor) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from lm_console.engine.multimodal.processing import MultiModalProcessor

    architectures = AutoConfig.from_pretrained(tiny_idefics3_dir).architectures
    processor = MultiModalProcessor(tiny_idefics3_dir, "tiny", architectures)
    tokenizer = AutoTokenizer.from_pretrained(tiny_idefics3_dir)
    for text, images in PROMPTS:
        processed = processor.process({"prompt": text, "multi_modal_data": {"image": images}}, tokenizer)
        expected = hf_processor(text=[text], images=[images])["input_ids"][0]
        assert processed.token_ids == list(expected)
        image_token = hf_processor.image_token_id
        for feature in processed.features:
            span = processed.token_ids[feature.offset:feature.offset + feature.length]
            assert span[0] == hf_processor.fake_image_token_id and span[-1] == hf_processor.fake_image_token_id
            assert feature.num_embeds == sum(t == image_token for t in span)
            assert feature.num_embeds % 4 == 0 and feature.data["pixel_values"].shape[0] == feature.num_embeds // 4


def test_greedy_equals_hf_on_image_prompts(tiny_idefics3_dir, hf_model, hf_processor, make_llm) -> None:
    max_tokens = 12
    llm = make_llm(str(tiny_idefics3_dir), multiprocess=False, dtype="float32", max_model_len=512,
                   kv_cache_memory=1 << 24)
    outputs = llm.generate([{"prompt": t, "multi_modal_data": {"image": i}} for t, i in PROMPTS],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)
    for (text, images), output in zip(PROMPTS, outputs):
        inputs = hf_processor(text=[text], images=[images], return_tensors="pt")
        with torch.inference_mode():
            generated = hf_model.generate(**inputs, do_sample=False, max_new_tokens=max_tokens,
                                          min_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
        assert output.prompt_token_ids == inputs["input_ids"][0].tolist()
        assert output.outputs[0].token_ids == generated[0, inputs["input_ids"].shape[1]:].tolist()


def test_image_changes_the_output(tiny_idefics3_dir, make_llm) -> None:
    """Guards against a merge that silently drops the image: another image, another answer."""
    llm = make_llm(str(tiny_idefics3_dir), multiprocess=False, dtype="float32", max_model_len=512,
                   kv_cache_memory=1 << 24)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first, second = llm.generate([{"prompt": "<image>Hi", "multi_modal_data": {"image": make_image(seed)}}
                                  for seed in (10, 11)], params, use_tqdm=False)
    assert first.prompt_token_ids == second.prompt_token_ids
    assert first.outputs[0].token_ids != second.outputs[0].token_ids
