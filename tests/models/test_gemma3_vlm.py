"""Gemma3 with images: our SigLIP tower + projector, prompt expansion (newline merge, image runs)
and greedy decoding equal transformers' Gemma3ForConditionalGeneration on a tiny random VLM."""

from __future__ import annotations

import pytest
import torch

from lm_console.engine import SamplingParams
from gemma3_vlm_helpers import assert_matches_hf, hf_greedy
from mm_factory import GEMMA3_MM_TOKENS, make_image

# The newline cases: the expansion's "\n\n" merges with "\n" before the placeholder ("\n\n\n")
# and after it, and two images side by side share one "\n\n\n\n" run between them.
PROMPTS = [
    ("user\n<start_of_image>What is in this image?", [make_image(1)]),
    ("Compare <start_of_image> and <start_of_image>\nplease.", [make_image(2, 40, 40), make_image(3, 70, 30)]),
    ("<start_of_image><start_of_image>Two", [make_image(4, 24, 60), make_image(5)]),
    ("Look:\n\n<start_of_image>\nok", [make_image(6, 64, 64)]),
]


@pytest.fixture(scope="module")
def hf_model(tiny_gemma3_vlm_dir):
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(tiny_gemma3_vlm_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def hf_processor(tiny_gemma3_vlm_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_gemma3_vlm_dir)


def test_vision_tower_and_projector_match_hf(tiny_gemma3_vlm_dir, hf_model, hf_processor) -> None:
    from transformers import AutoConfig

    from lm_console.engine.models.loader import load_model

    ours = load_model(tiny_gemma3_vlm_dir, AutoConfig.from_pretrained(tiny_gemma3_vlm_dir), torch.float32, "cpu")
    images = [make_image(1), make_image(3, 70, 30)]
    out = hf_processor(text=["<start_of_image><start_of_image>"], images=[images], return_tensors="pt")
    with torch.inference_mode():
        reference = hf_model.model.get_image_features(out["pixel_values"], return_dict=True).pooler_output
        per_item = [hf_processor(text=["<start_of_image>"], images=[[image]], return_tensors="pt")["pixel_values"]
                    for image in images]
        mine = ours.embed_multimodal(pixel_values=per_item)
    assert reference.shape == (2, GEMMA3_MM_TOKENS, 64)
    torch.testing.assert_close(torch.stack(mine), reference, atol=1e-5, rtol=1e-5)
    # Text rows are scaled by sqrt(hidden); the image rows are the projector output as is.
    ids = out["input_ids"][0]
    is_image = ids == hf_model.config.image_token_id
    with torch.inference_mode():
        merged = ours.embed_input_ids(ids, torch.cat(mine), is_image)
        expected = hf_model.model.get_input_embeddings()(ids.clamp(max=hf_model.config.text_config.vocab_size - 1))
    torch.testing.assert_close(merged[is_image], reference.reshape(-1, 64))
    torch.testing.assert_close(merged[~is_image], expected[~is_image])


def test_prompt_expansion_equals_hf_processor(tiny_gemma3_vlm_dir, hf_processor) -> None:
    from transformers import AutoConfig

    from lm_console.engine.multimodal.processing import MultiModalProcessor

    architectures = AutoConfig.from_pretrained(tiny_gemma3_vlm_dir).architectures
    processor = MultiModalProcessor(tiny_gemma3_vlm_dir, "tiny", architectures)
    tokenizer = hf_processor.tokenizer
    image_id = tokenizer.image_token_id
    merged_somewhere = False
    for text, images in PROMPTS:
        processed = processor.process({"prompt": text, "multi_modal_data": {"image": images}}, tokenizer)
        expected = hf_processor(text=[text], images=[images])
        assert processed.token_ids == list(expected["input_ids"][0])
        # Each PlaceholderRange is exactly one run of soft tokens, as HF's token_type_ids mark them.
        type_ids = list(expected["token_type_ids"][0])
        marked = [0] * len(type_ids)
        for feature in processed.features:
            assert feature.length == feature.num_embeds == GEMMA3_MM_TOKENS and feature.is_embed is None
            span = processed.token_ids[feature.offset:feature.offset + feature.length]
            assert set(span) == {image_id}
            assert processed.token_ids[feature.offset - 1] == tokenizer.boi_token_id
            assert processed.token_ids[feature.offset + feature.length] == tokenizer.eoi_token_id
            marked[feature.offset:feature.offset + feature.length] = [1] * feature.length
        assert marked == type_ids
        newline_runs = {tokenizer.encode("\n" * n, add_special_tokens=False)[0] for n in (3, 4)}
        merged_somewhere |= bool(newline_runs & set(processed.token_ids))
    assert merged_somewhere  # the cases above really exercise the merge

    # Token-id prompts take the same path: the spliced "\n" + "\n\n" becomes one "\n\n\n".
    text, images = PROMPTS[0]
    ids = tokenizer.encode(text)
    processed = processor.process({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, tokenizer)
    assert processed.token_ids == list(hf_processor(text=[text], images=[images])["input_ids"][0])


def test_stray_soft_token_in_the_prompt_is_rejected(tiny_gemma3_vlm_dir, hf_processor) -> None:
    from transformers import AutoConfig

    from lm_console.engine.errors import InvalidPromptError
    from lm_console.engine.multimodal.processing import MultiModalProcessor

    architectures = AutoConfig.from_pretrained(tiny_gemma3_vlm_dir).architectures
    processor = MultiModalProcessor(tiny_gemma3_vlm_dir, "tiny", architectures)
    with pytest.raises(InvalidPromptError, match="image_soft_token"):
        processor.process({"prompt": "<start_of_image>a<image_soft_token>",
                           "multi_modal_data": {"image": make_image(1)}}, hf_processor.tokenizer)


def test_greedy_equals_hf_on_image_prompts(tiny_gemma3_vlm_dir, hf_model, hf_processor, make_llm) -> None:
    max_tokens = 10
    llm = make_llm(str(tiny_gemma3_vlm_dir), dtype="float32", multiprocess=False, max_model_len=512,
                   kv_cache_memory=1 << 24, block_size=8, num_threads=1)
    outputs = llm.generate([{"prompt": t, "multi_modal_data": {"image": i}} for t, i in PROMPTS],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5),
                           use_tqdm=False)
    for (text, images), output in zip(PROMPTS, outputs):
        assert_matches_hf(output, hf_greedy(hf_model, hf_processor, text, images, max_tokens))


def test_bidirectional_image_attention_is_what_makes_it_exact(tiny_gemma3_vlm_dir, hf_model, hf_processor) -> None:
    """Guards the mask: with plain causal attention over the image tokens the logits differ from
    HF's, with the image spans they match (one prefill through the paged torch backend)."""
    from transformers import AutoConfig

    from lm_console.engine.models.loader import load_model

    text, images = PROMPTS[0]
    inputs = hf_processor(text=[text], images=[images], return_tensors="pt")
    with torch.inference_mode():
        expected = hf_model(**inputs).logits[0]
    ours = load_model(tiny_gemma3_vlm_dir, AutoConfig.from_pretrained(tiny_gemma3_vlm_dir), torch.float32, "cpu")
    ids = inputs["input_ids"][0]
    with_spans = prefill_logits(ours, ids, inputs["pixel_values"], bidirectional=True)
    causal = prefill_logits(ours, ids, inputs["pixel_values"], bidirectional=False)
    torch.testing.assert_close(with_spans, expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(causal, expected, atol=1e-3, rtol=1e-3)


def prefill_logits(model, ids: torch.Tensor, pixel_values: torch.Tensor, bidirectional: bool) -> torch.Tensor:
    """One whole-prompt prefill through the paged torch backend, with or without the image spans."""
    from lm_console.engine.attention import AttentionMetadata, bind_kv_caches, get_attention_layers, get_kv_cache_shape
    from lm_console.engine.forward_context import set_forward_context

    block_size, num_tokens = 16, int(ids.shape[0])
    num_blocks = -(-num_tokens // block_size)
    bind_kv_caches(model, [torch.zeros(get_kv_cache_shape(num_blocks + 1, block_size, a.num_kv_heads, a.head_dim))
                           for a in get_attention_layers(model)])
    is_image = ids == model.image_token_id
    positions = is_image.nonzero().squeeze(1).tolist()
    spans = [(positions[0], positions[-1] + 1)] if bidirectional else None
    md = AttentionMetadata(
        num_actual_tokens=num_tokens, num_reqs=1,
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_table=torch.arange(1, num_blocks + 1, dtype=torch.int32)[None],
        slot_mapping=torch.arange(block_size, block_size + num_tokens), max_query_len=num_tokens,
        max_seq_len=num_tokens, query_start_loc_cpu=[0, num_tokens], seq_lens_cpu=[num_tokens],
        block_size=block_size, bidirectional_spans={0: spans} if spans else None)
    with torch.inference_mode(), set_forward_context(md):
        embeds = model.embed_input_ids(ids, torch.cat(model.embed_multimodal(pixel_values=[pixel_values])), is_image)
        return model.compute_logits(model(ids, torch.arange(num_tokens), embeds))
