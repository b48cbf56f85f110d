"""LLM with images end to end: encoder cache sharing and eviction, prefix caching keyed by the
image, chunked prefill across an image, the processor cache across processes, chat content
parts, and bad input (each a specific error while the engine keeps serving)."""

from __future__ import annotations

import base64
import io

import pytest

from lm_console.engine import SamplingParams
from lm_console.engine.errors import (
    ImageNotFoundError, InvalidImageError, InvalidPromptError, MultiModalNotSupportedError,
    TooManyMultiModalItemsError,
)
from mm_factory import make_image, png_bytes

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = dict(multiprocess=False, dtype="float32", max_model_len=512, kv_cache_memory=1 << 24, block_size=16)


def image_prompt(image, text: str = "<image>What is this?") -> dict:
    return {"prompt": text, "multi_modal_data": {"image": image}}


def encoder_runner(llm):
    return llm.engine_core.engine_core.model_executor.worker.model_runner.encoder_runner


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def shared_llm(tiny_idefics3_dir):
    """One engine (no prefix caching) for the tests that only look at deltas and errors."""
    from lm_console.engine import LLM
    from llm_helpers import assert_no_leaked_blocks

    llm = LLM(str(tiny_idefics3_dir), enable_prefix_caching=False, **ENGINE)
    yield llm
    assert_no_leaked_blocks(llm)
    llm.shutdown()


def test_same_image_in_concurrent_requests_runs_the_encoder_once(tiny_idefics3_dir, make_llm) -> None:
    llm = make_llm(str(tiny_idefics3_dir), enable_prefix_caching=False, **ENGINE)
    image = make_image(1)
    outputs = llm.generate([image_prompt(image), image_prompt(image, "<image>Another question")], GREEDY,
                           use_tqdm=False)
    assert encoder_runner(llm).num_encoder_runs == 1
    stats = llm.get_stats().encoder_cache
    assert stats.num_encoder_runs == 1 and stats.num_hits == 1 and stats.num_entries == 1
    # Both requests are done: the entry is kept, freeable, not evicted.
    assert stats.num_used_slots == 0 and stats.num_freeable_slots == 20
    assert all(len(t) == 6 for t in tokens(outputs))


def test_evicted_entry_is_recomputed_with_the_same_result(tiny_idefics3_dir, make_llm) -> None:
    # Room for exactly one image (20 embeddings); no prefix cache, so every prompt needs its image.
    llm = make_llm(str(tiny_idefics3_dir), enable_prefix_caching=False, encoder_cache_size=20,
                   max_num_encoder_input_tokens=20, **ENGINE)
    a, b = make_image(1), make_image(2)
    first = llm.generate(image_prompt(a), GREEDY, use_tqdm=False)
    llm.generate(image_prompt(b), GREEDY, use_tqdm=False)  # evicts a
    again = llm.generate(image_prompt(a), GREEDY, use_tqdm=False)
    stats = llm.get_stats().encoder_cache
    assert stats.num_evictions == 2 and stats.num_encoder_runs == 3
    assert encoder_runner(llm).num_encoder_runs == 3
    assert len(encoder_runner(llm).encoder_cache) == 1  # the worker popped the evicted tensors
    assert tokens(first) == tokens(again)


def test_freeable_entry_is_reused_without_recompute(shared_llm) -> None:
    llm = shared_llm
    image = make_image(101)
    runs = encoder_runner(llm).num_encoder_runs
    first = llm.generate(image_prompt(image), GREEDY, use_tqdm=False)
    second = llm.generate(image_prompt(image), GREEDY, use_tqdm=False)
    assert encoder_runner(llm).num_encoder_runs == runs + 1
    assert tokens(first) == tokens(second)


def test_prefix_cache_blocks_are_keyed_by_the_image(tiny_idefics3_dir, make_llm) -> None:
    llm = make_llm(str(tiny_idefics3_dir), **ENGINE)
    text = "Here is a picture of something: <image> what do you see in it, exactly?"
    a, b = make_image(1), make_image(2)
    first = llm.generate(image_prompt(a, text), GREEDY, use_tqdm=False)[0]
    other = llm.generate(image_prompt(b, text), GREEDY, use_tqdm=False)[0]
    same = llm.generate(image_prompt(a, text), GREEDY, use_tqdm=False)[0]
    assert first.prompt_token_ids == other.prompt_token_ids == same.prompt_token_ids
    image_offset = first.prompt_token_ids.index(49152)  # <fake_token_around_image> opens the image
    # A different image behind identical tokens shares only the full blocks before the image.
    assert other.num_cached_tokens == image_offset // 16 * 16
    # The same image shares every full block (the last token is always recomputed).
    assert same.num_cached_tokens == (len(same.prompt_token_ids) - 1) // 16 * 16
    assert same.num_cached_tokens > image_offset + 20
    assert tokens([first]) == tokens([same])


@pytest.mark.parametrize("disable_chunked_mm_input", [False, True])
def test_chunked_prefill_across_an_image_matches_unchunked(tiny_idefics3_dir, make_llm,
                                                           disable_chunked_mm_input: bool) -> None:
    prompts = [image_prompt(make_image(1), "Look: <image> and then <image>, now answer."),
               image_prompt(make_image(5), "<image>Short one.")]
    prompts[0]["multi_modal_data"]["image"] = [make_image(1), make_image(3, 30, 60)]
    whole = make_llm(str(tiny_idefics3_dir), enable_prefix_caching=False, max_num_batched_tokens=512, **ENGINE)
    expected = tokens(whole.generate(prompts, GREEDY, use_tqdm=False))
    # 16 tokens a step: each image's 33-token placeholder spans three steps (or, with
    # disable_chunked_mm_input, waits for a step that fits it whole: max_num_batched_tokens 40).
    budget = 40 if disable_chunked_mm_input else 16
    chunked = make_llm(str(tiny_idefics3_dir), enable_prefix_caching=False, max_num_batched_tokens=budget,
                       disable_chunked_mm_input=disable_chunked_mm_input, **ENGINE)
    assert tokens(chunked.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert encoder_runner(chunked).num_encoder_runs == 3


def test_hash_is_the_same_for_a_path_bytes_and_a_data_url(shared_llm, tmp_path) -> None:
    llm = shared_llm
    runs = encoder_runner(llm).num_encoder_runs
    raw = png_bytes(make_image(7))
    path = tmp_path / "seven.png"
    path.write_bytes(raw)
    data_url = "data:image/png;base64," + base64.b64encode(raw).decode()
    outputs = llm.generate([image_prompt(str(path)), image_prompt(raw), image_prompt(data_url)], GREEDY,
                           use_tqdm=False)
    assert encoder_runner(llm).num_encoder_runs == runs + 1
    assert len(set(map(tuple, tokens(outputs)))) == 1


def test_user_mm_uuids_name_the_item(shared_llm) -> None:
    prompt = image_prompt(make_image(8))
    prompt["multi_modal_uuids"] = {"image": ["my-image-8"]}
    shared_llm.generate(prompt, GREEDY, use_tqdm=False)
    assert "my-image-8" in encoder_runner(shared_llm).encoder_cache


def test_chat_with_openai_content_parts(tiny_idefics3_dir, tmp_path, make_llm) -> None:
    llm = make_llm(str(tiny_idefics3_dir), **ENGINE)
    raw = png_bytes(make_image(9))
    path = tmp_path / "nine.png"
    path.write_bytes(raw)
    data_url = "data:image/png;base64," + base64.b64encode(raw).decode()
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url}},
        {"type": "text", "text": "and"},
        {"type": "image", "image": str(path)},
        {"type": "text", "text": "What differs?"}]}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    text = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                      {"type": "text", "text": "What differs?"}]}],
        tokenize=False, add_generation_prompt=True)
    assert text.count("<image>") == 2
    direct = llm.generate({"prompt": text, "prompt_token_ids": llm.get_tokenizer().encode(text, add_special_tokens=False),
                           "multi_modal_data": {"image": [raw, raw]}}, GREEDY, use_tqdm=False)[0]
    assert chat.prompt_token_ids == direct.prompt_token_ids
    assert tokens([chat]) == tokens([direct])
    assert encoder_runner(llm).num_encoder_runs == 1  # the same image twice


def test_processor_cache_sends_no_data_on_a_hit_across_processes(tiny_idefics3_dir, make_llm) -> None:
    llm = make_llm(str(tiny_idefics3_dir), multiprocess=True, max_model_len=512, kv_cache_memory=1 << 24,
                   enable_prefix_caching=False)
    image = make_image(1)
    first = llm.generate(image_prompt(image), GREEDY, use_tqdm=False)
    processor = llm.input_processor.mm_processor
    sent = []
    original = processor.finalize
    processor.finalize = lambda features: sent.append(original(features)) or sent[-1]
    second = llm.generate(image_prompt(image), GREEDY, use_tqdm=False)
    assert processor.num_hf_calls == 1  # the hit skipped the HF processor
    assert sent[0][0].data is None  # ... and the arrays stayed in the frontend
    assert tokens(first) == tokens(second)
    assert llm.get_stats().encoder_cache.num_encoder_runs == 1


def _tga_bytes() -> bytes:
    buffer = io.BytesIO()
    make_image(1).save(buffer, format="TGA")
    return buffer.getvalue()


@pytest.mark.parametrize("source, error", [
    ("/nonexistent/picture.png", ImageNotFoundError),
    (b"definitely not an image", InvalidImageError),
    (png_bytes(make_image(1))[:200], InvalidImageError),  # truncated PNG
    (_tga_bytes(), InvalidImageError),  # a format PIL reads but we do not accept
    ("data:image/png;base64,@@@", InvalidImageError),
    (12345, InvalidImageError),
])
def test_bad_images_are_rejected_and_the_engine_keeps_serving(shared_llm, source, error) -> None:
    llm = shared_llm
    with pytest.raises(error):
        llm.generate(image_prompt(source), GREEDY, use_tqdm=False)
    assert len(tokens(llm.generate(image_prompt(make_image(1)), GREEDY, use_tqdm=False))[0]) == 6


def test_too_many_images_for_max_model_len(tiny_idefics3_dir, make_llm) -> None:
    llm = make_llm(str(tiny_idefics3_dir), multiprocess=False, max_model_len=96, kv_cache_memory=1 << 24)
    with pytest.raises(TooManyMultiModalItemsError, match="max_model_len"):
        llm.generate(image_prompt([make_image(i) for i in range(3)], "<image><image><image>Hi"), GREEDY,
                     use_tqdm=False)
    with pytest.raises(InvalidPromptError, match="placeholders"):
        llm.generate(image_prompt([make_image(1)], "<image><image>Hi"), GREEDY, use_tqdm=False)
    assert tokens(llm.generate(image_prompt(make_image(1)), GREEDY, use_tqdm=False))


def test_image_sent_to_a_text_only_model(tiny_llama_dir, make_llm) -> None:
    llm = make_llm(str(tiny_llama_dir), multiprocess=False, max_model_len=128, kv_cache_memory=1 << 22)
    with pytest.raises(MultiModalNotSupportedError, match="text-only"):
        llm.generate(image_prompt(make_image(1)), GREEDY, use_tqdm=False)
    with pytest.raises(MultiModalNotSupportedError):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}], GREEDY)
    assert tokens(llm.generate("Hello", GREEDY, use_tqdm=False))


def test_issue_18_multimodal_inputs_get_specific_errors(shared_llm, monkeypatch) -> None:
    """Item 7: on main these raised DecompressionBombError, ZeroDivisionError, a raw validation
    error and TypeError instead of engine.errors types."""
    from PIL import Image

    from lm_console.engine.errors import MultiModalInputError

    llm = shared_llm
    cases = [
        ({"mm_processor_kwargs": {"max_image_size": {"longest_edge": 0}}}, MultiModalInputError),  # ZeroDivisionError
        ({"mm_processor_kwargs": {"do_resize": "x"}}, MultiModalInputError),  # a raw validation error
        ({"mm_processor_kwargs": {1: 2}}, InvalidPromptError),
        ({"multi_modal_uuids": 123}, InvalidPromptError),  # TypeError
        ({"multi_modal_uuids": [5]}, InvalidPromptError),
    ]
    for extra, error in cases:
        with pytest.raises(error):
            llm.generate({**image_prompt(make_image(1)), **extra}, GREEDY, use_tqdm=False)
    # A decompression bomb: PIL's pixel limit, lowered so a small PNG trips it.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(InvalidImageError, match="too many pixels"):
        llm.generate(image_prompt(png_bytes(make_image(1))), GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert len(tokens(llm.generate(image_prompt(make_image(1)), GREEDY, use_tqdm=False))[0]) == 6
