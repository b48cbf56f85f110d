"""demo-vlm sees: the image path checked by accuracy on held-out synthetic pictures.

A random-weights comparison with transformers proves the arithmetic, not that the picture
reaches the LM: a placeholder off by one, a wrong pixel-shuffle order or a stale encoder-cache
entry passes it as long as both sides make the same mistake. demo-vlm's tower and connector are
trained (tools/train_demo_vlm.py), so here the engine must name the colour and shape of pictures
it never saw, greedily, in >= 80% of 50, whatever way the picture arrives and however the
scheduler cuts the prompt (slow: the 135M demo VLM, a few hundred short requests).
"""

from __future__ import annotations

import base64

import pytest

from demo_vlm_helpers import MAX_TOKENS, accuracy, chat_messages, held_out, judge
from lm_console.engine import SamplingParams
from mm_factory import png_bytes

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
NUM_PICTURES = 50
ENGINE = dict(multiprocess=False, dtype="float32", max_model_len=512, enable_prefix_caching=False)


def texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


@pytest.fixture(scope="module")
def pictures():
    return held_out(NUM_PICTURES)


@pytest.fixture(scope="module")
def llm():
    from lm_console.engine import LLM
    from llm_helpers import assert_no_leaked_blocks

    engine = LLM("demo-vlm", num_gpu_blocks_override=1200, **ENGINE)
    yield engine
    assert_no_leaked_blocks(engine)
    engine.shutdown()


def encoder_runs(llm) -> int:
    return llm.get_stats().encoder_cache.num_encoder_runs


def test_names_colour_and_shape_for_every_kind_of_image_source(llm, pictures, tmp_path) -> None:
    """The same 50 pictures as PIL images, paths, PNG bytes and data: URLs: >= 80% right each way."""
    scenes = [scene for _, scene in pictures]
    raws = [png_bytes(image) for image, _ in pictures]
    paths = []
    for i, raw in enumerate(raws):
        paths.append(tmp_path / f"picture{i}.png")
        paths[-1].write_bytes(raw)
    sources = {
        "PIL": [image for image, _ in pictures],
        "path": [str(p) for p in paths],
        "bytes": raws,
        "data URL": ["data:image/png;base64," + base64.b64encode(raw).decode() for raw in raws],
    }
    runs = encoder_runs(llm)
    outputs = llm.chat([chat_messages(image) for kind in sources for image in sources[kind]], GREEDY,
                       use_tqdm=False)
    answers = texts(outputs)
    for k, kind in enumerate(sources):
        got = accuracy(answers[k * NUM_PICTURES:(k + 1) * NUM_PICTURES], scenes)
        assert got >= 0.8, f"{kind}: colour and shape right in {got:.0%} of {NUM_PICTURES} pictures"
    # A path, its bytes and its data: URL are the same PNG: one hash, one encoder run. The PIL
    # image hashes by its pixels: one more.
    assert encoder_runs(llm) - runs == 2 * NUM_PICTURES
    counts = sum(judge(a, s).count for a, s in zip(answers[:NUM_PICTURES], scenes)) / NUM_PICTURES
    assert counts >= 0.7, f"the number of shapes said in {counts:.0%} of the answers"


def test_same_pictures_again_hit_the_processor_and_encoder_caches(llm) -> None:
    """Ten new pictures, then the same ten again: the second round skips the HF processor and the
    encoder, and answers the same (right, as often as the first round)."""
    pictures = held_out(10, offset=NUM_PICTURES)
    processor = llm.input_processor.mm_processor
    calls, runs = processor.num_hf_calls, encoder_runs(llm)
    first = texts(llm.chat([chat_messages(image) for image, _ in pictures], GREEDY, use_tqdm=False))
    assert processor.num_hf_calls == calls + 10 and encoder_runs(llm) == runs + 10
    second = texts(llm.chat([chat_messages(image) for image, _ in pictures], GREEDY, use_tqdm=False))
    assert processor.num_hf_calls == calls + 10  # the ProcessorCache answered the second round
    assert encoder_runs(llm) == runs + 10  # ... and so did the encoder cache
    assert second == first
    assert accuracy(first, [scene for _, scene in pictures]) >= 0.7, first


def test_two_pictures_in_one_prompt_come_in_order(llm) -> None:
    """Pictures A and B in one prompt, then B and A: the 135M LM describes mostly the first one
    it reads, so its first colour and shape follow the order of the images in the prompt."""
    pictures = held_out(20, offset=300)
    firsts, seconds = pictures[0::2], pictures[1::2]

    def prompt(a, b) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image", "image": a}, {"type": "image", "image": b},
                                             {"type": "text", "text": "Describe the pictures."}]}]

    forward = texts(llm.chat([prompt(a, b) for (a, _), (b, _) in zip(firsts, seconds)], GREEDY, use_tqdm=False))
    backward = texts(llm.chat([prompt(b, a) for (a, _), (b, _) in zip(firsts, seconds)], GREEDY, use_tqdm=False))
    assert accuracy(forward, [scene for _, scene in firsts]) >= 0.7, forward
    assert accuracy(backward, [scene for _, scene in seconds]) >= 0.7, backward


def test_chunked_prefill_through_the_image_and_preemption(pictures) -> None:
    """A 16-token budget is shorter than an image's placeholder run (its 16 embeddings between
    <fake_token_around_image><global-img> and <fake_token_around_image>), so every image is cut
    across steps; a 16-block KV pool (about three requests) preempts requests mid-answer. Same accuracy."""
    from lm_console.engine import LLM
    from lm_console.engine.models.demo_vlm import DEMO_IMAGE_SEQ_LEN
    from llm_helpers import assert_no_leaked_blocks

    budget = 16
    llm = LLM("demo-vlm", num_gpu_blocks_override=16, max_num_batched_tokens=budget,
              **{**ENGINE, "max_model_len": 128})
    try:
        # The placeholder run: <fake_token_around_image><global-img>, the embeddings, <fake_token_around_image>.
        assert DEMO_IMAGE_SEQ_LEN + 3 > budget  # no step can hold a whole image
        outputs = llm.chat([chat_messages(image) for image, _ in pictures[:30]], GREEDY, use_tqdm=False)
        assert llm.get_stats().num_preemptions_total > 0
        got = accuracy(texts(outputs), [scene for _, scene in pictures[:30]])
        assert got >= 0.8, f"colour and shape right in {got:.0%} of 30 pictures"
        assert_no_leaked_blocks(llm)
    finally:
        llm.shutdown()


def test_transformers_loads_the_trained_weights_and_agrees(llm) -> None:
    """HF's Idefics3 on the demo-vlm directory gives the engine's image embeddings, and those are
    the LM's embeddings of the picture's caption (nearest token per embedding)."""
    import torch
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    from lm_console.engine.models.demo_vlm import caption_slots
    from lm_console.engine.models.embedded import resolve_model_path

    path = resolve_model_path("demo-vlm")
    hf = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    pictures = held_out(8, offset=200)
    pixels = processor.image_processor(images=[[image] for image, _ in pictures], return_tensors="pt")["pixel_values"]
    model = llm.engine_core.engine_core.model_executor.worker.model_runner.model
    with torch.no_grad():
        ours = torch.stack(model.embed_multimodal([p for p in pixels]))  # [8, 16, hidden]
        theirs = hf.model.connector(hf.model.vision_model(pixel_values=pixels[:, 0]).last_hidden_state)
        table = hf.model.text_model.embed_tokens.weight
        nearest = (torch.nn.functional.normalize(theirs, dim=-1)
                   @ torch.nn.functional.normalize(table, dim=-1).T).argmax(-1)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    expected = torch.tensor([caption_slots(processor.tokenizer, scene) for _, scene in pictures])
    assert (nearest == expected).all(-1).float().mean() >= 0.75
