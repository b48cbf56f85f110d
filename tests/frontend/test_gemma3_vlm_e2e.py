"""Gemma3 with images through LLM: HF exactness with the encoder shared by two requests,
chunked prefill around an image (never inside it: attention within an image is bidirectional),
prefix caching on and off, LLM() in its own process, and a budget too small for one image."""

from __future__ import annotations

import pytest

from lm_console.engine import SamplingParams
from lm_console.engine.errors import TooManyMultiModalItemsError
from gemma3_vlm_helpers import assert_matches_hf, hf_greedy
from mm_factory import GEMMA3_MM_TOKENS, make_image

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
# One torch thread: the tiny matmuls only lose to thread hand-offs on a busy 2-core machine.
ENGINE = dict(dtype="float32", multiprocess=False, max_model_len=256, kv_cache_memory=1 << 24, block_size=8,
              num_threads=1)
SHARED = make_image(21)
NUM_PREEMPT_BLOCKS = 46  # the least max_model_len=80 admits: six requests preempt each other
# Two prompts on one image (and prefix), one on another image; the image starts at token 6.
PROMPTS = [
    ("user\n<start_of_image>What is this?", [SHARED]),
    ("user\n<start_of_image>Describe it.", [SHARED]),
    ("Compare <start_of_image> and <start_of_image>\nnow", [make_image(22, 40, 40), SHARED]),
]


def requests() -> list[dict]:
    return [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in PROMPTS]


def encoder_runner(llm):
    return llm.engine_core.engine_core.model_executor.worker.model_runner.encoder_runner


@pytest.fixture(scope="module")
def hf_expected(tiny_gemma3_vlm_dir):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration
    import torch

    model = Gemma3ForConditionalGeneration.from_pretrained(tiny_gemma3_vlm_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(tiny_gemma3_vlm_dir)
    return [hf_greedy(model, processor, text, images, MAX_TOKENS) for text, images in PROMPTS]


def record_chunks(llm) -> list[dict[str, tuple[int, int]]]:
    """Wrap the scheduler so each step's (start, end) token range per request is recorded."""
    scheduler = llm.engine_core.engine_core.scheduler
    steps: list[dict[str, tuple[int, int]]] = []
    schedule = scheduler.schedule

    def recording():
        output = schedule()
        steps.append({r: (scheduler.requests[r].num_computed_tokens - n if r in scheduler.requests else -1,
                          scheduler.requests[r].num_computed_tokens if r in scheduler.requests else -1)
                      for r, n in output.num_scheduled_tokens.items()})
        return output

    scheduler.schedule = recording
    return steps


def test_encoder_runs_once_for_an_image_in_concurrent_requests(tiny_gemma3_vlm_dir, hf_expected, make_llm) -> None:
    llm = make_llm(str(tiny_gemma3_vlm_dir), enable_prefix_caching=False, **ENGINE)
    outputs = llm.generate(requests(), GREEDY, use_tqdm=False)
    for output, expected in zip(outputs, hf_expected):
        assert_matches_hf(output, expected)
    # Three requests, four image slots, two distinct images: two encoder runs.
    assert encoder_runner(llm).num_encoder_runs == 2
    stats = llm.get_stats().encoder_cache
    assert stats.num_encoder_runs == 2 and stats.num_entries == 2 and stats.num_hits == 2


def test_chunked_prefill_never_splits_an_image_and_matches_hf(tiny_gemma3_vlm_dir, hf_expected, make_llm) -> None:
    # A 20-token budget: a plain chunker would cut the first image (tokens 6..21) at token 20.
    llm = make_llm(str(tiny_gemma3_vlm_dir), enable_prefix_caching=False, max_num_batched_tokens=20,
                   max_num_seqs=4, **ENGINE)
    steps = record_chunks(llm)
    outputs = llm.generate(requests(), GREEDY, use_tqdm=False)
    for output, expected in zip(outputs, hf_expected):
        assert_matches_hf(output, expected)
    image_id = llm.config.model_config.hf_config.image_token_id
    spans = {}
    for i, output in enumerate(outputs):
        positions = [p for p, t in enumerate(output.prompt_token_ids) if t == image_id]
        spans[str(i)] = [(positions[k], positions[k] + GEMMA3_MM_TOKENS)
                         for k in range(0, len(positions), GEMMA3_MM_TOKENS)]
    prefill_chunks = 0
    for step in steps:
        for req_id, (start, end) in step.items():
            for image_start, image_end in spans[req_id]:
                assert not image_start < end < image_end, (req_id, start, end, image_start)
            prefill_chunks += end - start > 1
    assert prefill_chunks > len(PROMPTS)  # the budget really chunked the prompts


def test_prefix_caching_on_and_off_give_identical_outputs(tiny_gemma3_vlm_dir, hf_expected, make_llm) -> None:
    off = make_llm(str(tiny_gemma3_vlm_dir), enable_prefix_caching=False, **ENGINE)
    baseline = off.generate(requests(), GREEDY, use_tqdm=False)
    on = make_llm(str(tiny_gemma3_vlm_dir), enable_prefix_caching=True, **ENGINE)
    first = on.generate(requests(), GREEDY, use_tqdm=False)
    again = on.generate(requests(), GREEDY, use_tqdm=False)  # hits through the image blocks
    assert sum(o.num_cached_tokens for o in again) > 3 * 8
    for outputs in (first, again):
        for output, reference, expected in zip(outputs, baseline, hf_expected):
            assert output.outputs[0].token_ids == reference.outputs[0].token_ids
            assert_matches_hf(output, expected)


def test_llm_in_its_own_process_serves_text_and_images(tiny_gemma3_vlm_dir, hf_expected, make_llm) -> None:
    """The core resolves the VLM's nested text_config (vocab size, max positions) for the frontend."""
    from lm_console.engine.errors import InvalidPromptError

    llm = make_llm(str(tiny_gemma3_vlm_dir), **{**ENGINE, "multiprocess": True})
    model_config = llm.config.model_config
    assert model_config.max_model_len == 256 and model_config.is_multimodal
    text_config = model_config.hf_config.get_text_config()  # the test may load transformers
    assert model_config.vocab_size == text_config.vocab_size
    assert model_config.max_position_embeddings == text_config.max_position_embeddings
    image, text = llm.generate([requests()[0], {"prompt": "hello"}], GREEDY, use_tqdm=False)
    assert_matches_hf(image, hf_expected[0])
    # The same image again: a ProcessorCache hit (no HF processor call, no pixels sent), and the
    # placeholder ranges are located again in the new prompt.
    mm_processor = llm.input_processor.mm_processor
    calls = mm_processor.num_hf_calls
    assert_matches_hf(llm.generate(requests()[1], GREEDY, use_tqdm=False)[0], hf_expected[1])
    assert mm_processor.num_hf_calls == calls
    assert len(text.outputs[0].token_ids) == MAX_TOKENS
    vocab = model_config.vocab_size
    with pytest.raises(InvalidPromptError):
        llm.generate({"prompt_token_ids": [2, vocab]}, GREEDY, use_tqdm=False)


def test_budget_smaller_than_an_image_is_a_clear_error(tiny_gemma3_vlm_dir, make_llm) -> None:
    llm = make_llm(str(tiny_gemma3_vlm_dir), enable_prefix_caching=False, max_num_batched_tokens=12,
                   max_num_seqs=4, **ENGINE)
    with pytest.raises(TooManyMultiModalItemsError, match="max_num_batched_tokens"):
        llm.generate(requests()[0], GREEDY, use_tqdm=False)
    assert len(llm.generate({"prompt": "still serving"}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == MAX_TOKENS


def test_preemption_recomputes_images_exactly(tiny_gemma3_vlm_dir, make_llm) -> None:
    # A pool too small for six requests at once: some are preempted and recomputed,
    # running their image through the encoder (or its cache) and the bidirectional mask again.
    params = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True, logprobs=5)
    engine = {**ENGINE, "kv_cache_memory": None, "max_model_len": 80, "enable_prefix_caching": False,
              "max_num_batched_tokens": 32}
    roomy = make_llm(str(tiny_gemma3_vlm_dir), **engine, num_gpu_blocks_override=1024)
    baseline = roomy.generate(requests() * 2, params, use_tqdm=False)
    tight = make_llm(str(tiny_gemma3_vlm_dir), **engine, num_gpu_blocks_override=NUM_PREEMPT_BLOCKS)
    outputs = tight.generate(requests() * 2, params, use_tqdm=False)
    assert tight.get_stats().num_preemptions_total > 0
    for output, reference in zip(outputs, baseline):
        assert output.outputs[0].token_ids == reference.outputs[0].token_ids
        for ours, theirs in zip(output.outputs[0].logprobs, reference.outputs[0].logprobs, strict=True):
            assert sorted(ours) == sorted(theirs)  # batch composition differs: fp32 noise only
            assert [ours[t].logprob for t in sorted(ours)] == pytest.approx(
                [theirs[t].logprob for t in sorted(theirs)], rel=1e-5, abs=1e-4)


def test_chat_with_an_image_part_equals_hf(tiny_gemma3_vlm_dir, make_llm) -> None:
    """OpenAI-style content parts through Gemma3's chat template ("user\\n" + the expansion's
    "\\n\\n" merge into one token) give HF's prompt ids and greedy tokens."""
    import base64

    import torch
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    from mm_factory import png_bytes

    image = make_image(23)
    url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    llm = make_llm(str(tiny_gemma3_vlm_dir), enable_prefix_caching=False, **ENGINE)
    output = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                    {"type": "text", "text": "What is this?"}]}], GREEDY)[0]
    processor = AutoProcessor.from_pretrained(tiny_gemma3_vlm_dir)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": "What is this?"}]}],
                                         add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[[image]], return_tensors="pt", add_special_tokens=False)
    model = Gemma3ForConditionalGeneration.from_pretrained(tiny_gemma3_vlm_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        generated = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                   eos_token_id=None, pad_token_id=0)
    assert output.prompt_token_ids == inputs["input_ids"][0].tolist()
    newline3 = processor.tokenizer.encode("\n\n\n", add_special_tokens=False)
    assert len(newline3) == 1 and newline3[0] in output.prompt_token_ids
    assert output.outputs[0].token_ids == generated[0, inputs["input_ids"].shape[1]:].tolist()
