"""ExampleConnector: safetensors hand-off between two engines, layer-by-layer synchronous loads,
and an unreadable file turning into a recompute (the scheduler's sync-load error path)."""

from __future__ import annotations

import random

import pytest

from lm_console.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def prompts() -> list[dict]:
    rng = random.Random(7)
    return [{"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(n)]} for n in (100, 70, 33)]


def config(path, role: str) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"storage_path": str(path)}}


def build(make_llm, model_dir, kv_config=None):
    return make_llm(str(model_dir), dtype="float32", max_model_len=256, multiprocess=False,
                    kv_transfer_config=kv_config)


@pytest.fixture(scope="module")
def expected(tiny_qwen3_dir) -> list[list[int]]:
    llm = LLM(str(tiny_qwen3_dir), dtype="float32", max_model_len=256, multiprocess=False)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_producer_saves_consumer_loads_layer_by_layer(make_llm, tiny_qwen3_dir, tmp_path, expected) -> None:
    producer = build(make_llm, tiny_qwen3_dir, config(tmp_path, "kv_producer"))
    assert [o.outputs[0].token_ids for o in producer.generate(prompts(), GREEDY, use_tqdm=False)] == expected
    assert len(list(tmp_path.glob("*/layer.1.safetensors"))) == 3
    consumer = build(make_llm, tiny_qwen3_dir, config(tmp_path, "kv_consumer"))
    outputs = consumer.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.num_cached_tokens for o in outputs] == [96, 64, 32]


@pytest.mark.slow
def test_unreadable_file_is_recomputed(make_llm, tiny_qwen3_dir, tmp_path, expected) -> None:
    build(make_llm, tiny_qwen3_dir, config(tmp_path, "kv_producer")).generate(prompts(), GREEDY, use_tqdm=False)
    for file in tmp_path.glob("*/layer.1.safetensors"):
        file.write_bytes(b"not safetensors")
    consumer = build(make_llm, tiny_qwen3_dir, config(tmp_path, "kv_consumer"))
    outputs = consumer.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert list(tmp_path.iterdir()) == []  # the bad entries were dropped


def test_an_int8_cache_hands_off_to_int8_and_never_to_a_float_cache(make_llm, tiny_qwen3_dir, tmp_path) -> None:
    """The files hold the cache's own bytes: an int8 consumer loads an int8 producer's blocks (same
    outputs as without the connector); a float32 consumer refuses them and recomputes."""

    def engine(kv_config, kv_cache_dtype):
        return make_llm(str(tiny_qwen3_dir), dtype="float32", kv_cache_dtype=kv_cache_dtype, max_model_len=256,
                        multiprocess=False, kv_transfer_config=kv_config)

    int8_expected = [o.outputs[0].token_ids for o in engine(None, "int8").generate(prompts(), GREEDY, use_tqdm=False)]
    engine(config(tmp_path / "a", "kv_producer"), "int8").generate(prompts(), GREEDY, use_tqdm=False)
    outputs = engine(config(tmp_path / "a", "kv_consumer"), "int8").generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == int8_expected
    assert [o.num_cached_tokens for o in outputs] == [96, 64, 32]
    float_expected = [o.outputs[0].token_ids for o in engine(None, "auto").generate(prompts(), GREEDY, use_tqdm=False)]
    engine(config(tmp_path / "b", "kv_producer"), "int8").generate(prompts(), GREEDY, use_tqdm=False)
    outputs = engine(config(tmp_path / "b", "kv_consumer"), "auto").generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == float_expected
    assert list((tmp_path / "b").iterdir()) == []  # refused and dropped, then recomputed
