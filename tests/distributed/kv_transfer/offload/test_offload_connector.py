"""OffloadConnector end to end on tiny models and the embedded model: greedy outputs identical with
offload on and off, reuse after the prefix cache forgot, after a restart, across two engine
processes, P/D hand-off; every injected fault ends in a recompute with the same output."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from lm_console.engine import LLM, SamplingParams
from lm_console.engine.distributed.kv_transfer.offload import store as store_module
from lm_console.engine.errors import InvalidEngineArgsError

CHUNK = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LENGTHS = (100, 70, 33)
EXPECTED_HITS = [96, 64, 32]  # whole chunks, at most num_tokens - 1, in whole blocks
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # a hang fails fast instead of stalling the suite


def offload_config(disk_path: Path | None, role: str = "kv_both", **extra: object) -> dict:
    config = {"chunk_size": CHUNK, "cpu_bytes": 1 << 22, "disk_bytes": 1 << 24, **extra}
    if disk_path is not None:
        config["disk_path"] = str(disk_path)
    return {"kv_connector": "OffloadConnector", "kv_role": role, "kv_connector_extra_config": config}


def make_prompts(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(n)]} for n in LENGTHS]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def tiers(llm) -> dict:
    return {t.medium: t for t in llm.get_stats().kv_tiers or []}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[list[int]]:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, multiprocess=False)
    try:
        return tokens(llm.generate(make_prompts(), GREEDY, use_tqdm=False))
    finally:
        llm.shutdown()


def engine(make_llm, model_dir, config, multiprocess: bool = False, **args):
    return make_llm(str(model_dir), dtype="float32", max_model_len=256, multiprocess=multiprocess,
                    kv_transfer_config=config, **args)


def connector_of(llm):
    return llm.engine_core.engine_core.kv_connector


@pytest.mark.parametrize("load_mode", ["async", "layerwise"])
def test_identical_outputs_and_reuse_after_the_prefix_cache_forgot(make_llm, tiny_llama_dir, reference,
                                                                   load_mode) -> None:
    llm = engine(make_llm, tiny_llama_dir, offload_config(None, load_mode=load_mode))
    assert tokens(llm.generate(make_prompts(), GREEDY, use_tqdm=False)) == reference
    assert llm.reset_prefix_cache()
    outputs = llm.generate(make_prompts(), GREEDY, use_tqdm=False)
    assert tokens(outputs) == reference
    assert [o.num_cached_tokens for o in outputs] == EXPECTED_HITS
    cpu = tiers(llm)["CPU"]
    assert cpu.num_chunks == 6 and cpu.hits == 6 and cpu.bytes_out == 6 * cpu.used_bytes // 6


@pytest.mark.parametrize("load_mode", ["async", "layerwise"])
def test_loaded_kv_is_really_used(make_llm, tiny_llama_dir, reference, load_mode) -> None:
    """Spoil the stored chunks: if the loads were ignored, the outputs would not change."""
    llm = engine(make_llm, tiny_llama_dir, offload_config(None, load_mode=load_mode))
    llm.generate(make_prompts(), GREEDY, use_tqdm=False)
    import torch

    with torch.inference_mode():
        for tensor in connector_of(llm).store.cpu._chunks.values():
            tensor.normal_(std=10.0)
    llm.reset_prefix_cache()
    assert tokens(llm.generate(make_prompts(), GREEDY, use_tqdm=False)) != reference


def test_restart_loads_from_disk(make_llm, tiny_llama_dir, reference, tmp_path) -> None:
    config = json.dumps(offload_config(tmp_path))  # the JSON string form
    first = engine(make_llm, tiny_llama_dir, config)
    first.generate(make_prompts(), GREEDY, use_tqdm=False)
    first.shutdown()  # joins the disk writer
    assert len(list(tmp_path.glob("*.kvchunk"))) == 6
    second = engine(make_llm, tiny_llama_dir, config)
    outputs = second.generate(make_prompts(), GREEDY, use_tqdm=False)
    assert tokens(outputs) == reference and [o.num_cached_tokens for o in outputs] == EXPECTED_HITS
    disk = tiers(second)["DISK"]
    assert disk.hits == 6 and disk.bytes_out > 0 and disk.errors == 0


@pytest.mark.slow
def test_two_engine_processes_share_the_disk_tier(make_llm, tiny_llama_dir, reference, tmp_path) -> None:
    a = engine(make_llm, tiny_llama_dir, offload_config(tmp_path), multiprocess=True)
    b = engine(make_llm, tiny_llama_dir, offload_config(tmp_path), multiprocess=True)
    assert tokens(a.generate(make_prompts(), GREEDY, use_tqdm=False)) == reference
    assert a.engine_core.call_utility("flush_kv_connector", 30.0)
    outputs = b.generate(make_prompts(), GREEDY, use_tqdm=False)
    assert tokens(outputs) == reference and [o.num_cached_tokens for o in outputs] == EXPECTED_HITS
    assert tiers(b)["DISK"].hits == 6


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_chunk_files_are_recomputed(make_llm, tiny_llama_dir, reference, tmp_path, damage) -> None:
    config = offload_config(tmp_path)
    first = engine(make_llm, tiny_llama_dir, config)
    first.generate(make_prompts(), GREEDY, use_tqdm=False)
    first.shutdown()
    second = engine(make_llm, tiny_llama_dir, config)
    # Lookups see every file; then each one is damaged before the load reads it.
    original_get = store_module.TieredKVStore.get

    def damaging_get(self, key):
        file = tmp_path / (key.hex() + ".kvchunk")
        if file.exists():
            data = bytearray(file.read_bytes())
            if damage == "flip":
                data[-7] ^= 0x5A
                file.write_bytes(data)
            elif damage == "truncate":
                file.write_bytes(data[: len(data) // 2])
            else:
                file.unlink()
        return original_get(self, key)

    store_module.TieredKVStore.get = damaging_get
    try:
        outputs = second.generate(make_prompts(), GREEDY, use_tqdm=False)
    finally:
        store_module.TieredKVStore.get = original_get
    assert tokens(outputs) == reference
    disk = tiers(second)["DISK"]
    assert disk.errors == (0 if damage == "delete" else 3)  # the first chunk of each prompt fails
    third = second.generate(make_prompts(), GREEDY, use_tqdm=False)  # recomputed chunks were stored again
    assert tokens(third) == reference


@pytest.mark.slow
def test_load_that_never_completes_times_out_into_recompute(make_llm, tiny_llama_dir, reference) -> None:
    llm = engine(make_llm, tiny_llama_dir, offload_config(None, load_timeout_s=0.2))
    llm.generate(make_prompts(), GREEDY, use_tqdm=False)
    llm.reset_prefix_cache()
    original_get = store_module.TieredKVStore.get

    def hanging_get(self, key):
        time.sleep(1.0)
        return original_get(self, key)

    store_module.TieredKVStore.get = hanging_get
    try:
        outputs = llm.generate(make_prompts(), GREEDY, use_tqdm=False)
    finally:
        store_module.TieredKVStore.get = original_get
    assert tokens(outputs) == reference
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 0]
    time.sleep(1.2)  # the stuck reader wakes up: it must not write into blocks it no longer owns
    llm.reset_prefix_cache()
    assert tokens(llm.generate(make_prompts(), GREEDY, use_tqdm=False)) == reference


@pytest.mark.slow
def test_layer_by_layer_load_timeout_recomputes(make_llm, tiny_llama_dir, reference, monkeypatch) -> None:
    from lm_console.engine.distributed.kv_transfer.offload import worker_side

    llm = engine(make_llm, tiny_llama_dir, offload_config(None, load_timeout_s=0.2, load_mode="layerwise"))
    worker = llm.engine_core.engine_core.model_executor.worker.model_runner.kv_connector._worker
    worker.layer_copy_thread = True  # the GPU's loader thread, which can fall behind the forward
    llm.generate(make_prompts(), GREEDY, use_tqdm=False)
    llm.reset_prefix_cache()
    original = worker_side.scatter_chunk_layer
    calls = []

    def slow_scatter(*args):
        calls.append(1)
        time.sleep(0.5)
        return original(*args)

    monkeypatch.setattr(worker_side, "scatter_chunk_layer", slow_scatter)
    outputs = llm.generate(make_prompts(), GREEDY, use_tqdm=False)
    assert calls and tokens(outputs) == reference
    monkeypatch.setattr(worker_side, "scatter_chunk_layer", original)
    llm.reset_prefix_cache()
    outputs = llm.generate(make_prompts(), GREEDY, use_tqdm=False)
    assert tokens(outputs) == reference and [o.num_cached_tokens for o in outputs] == EXPECTED_HITS


@pytest.mark.slow
def test_unusable_disk_warns_and_keeps_serving(make_llm, tiny_llama_dir, reference, tmp_path, caplog) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level("WARNING"):
        llm = engine(make_llm, tiny_llama_dir, offload_config(blocker / "kv"))
        assert tokens(llm.generate(make_prompts(), GREEDY, use_tqdm=False)) == reference
        llm.reset_prefix_cache()
        outputs = llm.generate(make_prompts(), GREEDY, use_tqdm=False)
    assert tokens(outputs) == reference and [o.num_cached_tokens for o in outputs] == EXPECTED_HITS
    assert len([r for r in caplog.records if "will not be stored on disk" in r.message]) == 1


def test_limits_below_one_chunk_fail_at_start(tiny_llama_dir) -> None:
    with pytest.raises(InvalidEngineArgsError, match="smaller than one chunk"):
        LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, multiprocess=False,
            kv_transfer_config=offload_config(None, cpu_bytes=1024))
    with pytest.raises(InvalidEngineArgsError, match="kv_role"):
        LLM(str(tiny_llama_dir), multiprocess=False, kv_transfer_config={"kv_connector": "OffloadConnector",
                                                                           "kv_role": "both"})


@pytest.mark.slow
def test_prefill_decode_disaggregation(make_llm, tiny_llama_dir, reference, tmp_path) -> None:
    producer = engine(make_llm, tiny_llama_dir, offload_config(tmp_path, role="kv_producer"))
    consumer = engine(make_llm, tiny_llama_dir, offload_config(tmp_path, role="kv_consumer"))
    prefilled = producer.generate(make_prompts(), SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    params = [o.kv_transfer_params for o in prefilled]
    assert params[0] == {"do_remote_prefill": True, "num_chunks": 3, "chunk_size": CHUNK}
    # The consumer may see the request before the producer's writes land: it waits for them.
    requests = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                               extra_args={"kv_transfer_params": p}) for p in params]
    outputs = consumer.generate(make_prompts(), requests, use_tqdm=False)
    assert tokens(outputs) == reference and [o.num_cached_tokens for o in outputs] == EXPECTED_HITS
    assert tiers(consumer)["DISK"].hits == 6


def test_consumer_gives_up_waiting_for_missing_remote_kv(make_llm, tiny_llama_dir, reference, tmp_path) -> None:
    consumer = engine(make_llm, tiny_llama_dir, offload_config(tmp_path, role="kv_consumer", remote_wait_s=0.2))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                            extra_args={"kv_transfer_params": {"do_remote_prefill": True, "num_chunks": 3}})
    outputs = consumer.generate(make_prompts(), params, use_tqdm=False)
    assert tokens(outputs) == reference and [o.num_cached_tokens for o in outputs] == [0, 0, 0]


@pytest.mark.slow
def test_qwen3_identical_with_offload(make_llm, tiny_qwen3_dir, tmp_path) -> None:
    plain = engine(make_llm, tiny_qwen3_dir, None)
    expected = tokens(plain.generate(make_prompts(1), GREEDY, use_tqdm=False))
    llm = engine(make_llm, tiny_qwen3_dir, offload_config(tmp_path))
    assert tokens(llm.generate(make_prompts(1), GREEDY, use_tqdm=False)) == expected
    llm.reset_prefix_cache()
    outputs = llm.generate(make_prompts(1), GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected and [o.num_cached_tokens for o in outputs] == EXPECTED_HITS


@pytest.mark.slow
def test_embedded_model_identical_with_offload_and_after_restart(make_llm, tmp_path) -> None:
    from llm_helpers import text_prompts

    def build(config):
        return make_llm(None, dtype="float32", max_model_len=1024, kv_cache_memory=64 << 20,
                        multiprocess=False, kv_transfer_config=config)

    plain = build(None)
    prompts = [{"prompt_token_ids": p} for p in text_prompts(plain.get_tokenizer(), 1, 290, 290, seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    expected = tokens(plain.generate(prompts, params, use_tqdm=False))
    plain.shutdown()
    config = {"kv_connector": "OffloadConnector",
              "kv_connector_extra_config": {"disk_path": str(tmp_path), "cpu_bytes": 1 << 27}}
    first = build(config)
    assert tokens(first.generate(prompts, params, use_tqdm=False)) == expected
    first.shutdown()
    second = build(config)  # a restart: only the disk tier remembers
    outputs = second.generate(prompts, params, use_tqdm=False)
    assert tokens(outputs) == expected
    assert [o.num_cached_tokens for o in outputs] == [256]
    assert tiers(second)["DISK"].hits == 1


@pytest.mark.slow
def test_offload_without_prefix_caching_and_with_decode_chunks(make_llm, tiny_llama_dir, reference) -> None:
    llm = engine(make_llm, tiny_llama_dir, offload_config(None, save_decode=True), enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = llm.generate(make_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids[:6] for o in first] == reference
    # Prompt + output chunks were stored: a prompt that repeats prompt + output hits all of them.
    longer = [{"prompt_token_ids": p["prompt_token_ids"] + o.outputs[0].token_ids} for p, o in zip(make_prompts(), first)]
    outputs = llm.generate(longer, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [128, 96, 64]
    plain = engine(make_llm, tiny_llama_dir, None)
    assert tokens(outputs) == tokens(plain.generate(longer, GREEDY, use_tqdm=False))


@pytest.mark.slow
def test_under_memory_pressure_with_preemption_and_chunked_prefill(make_llm, tiny_llama_dir, tmp_path) -> None:
    """A KV cache of 13 usable blocks, a 32-token step budget, prompts that share prefixes: loads, saves,
    preemptions and evictions interleave; the tokens must match a plain engine and nothing leaks."""
    rng = random.Random(11)
    bases = [[rng.randrange(3, 1000) for _ in range(96)] for _ in range(2)]
    prompts = [{"prompt_token_ids": bases[i % 2][: 40 + 13 * i] + [rng.randrange(3, 1000) for _ in range(5)]}
               for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    args = dict(num_gpu_blocks_override=14, max_num_batched_tokens=32, max_num_seqs=4)
    plain = make_llm(str(tiny_llama_dir), dtype="float32", max_model_len=160, multiprocess=False, **args)
    expected = tokens(plain.generate(prompts, params, use_tqdm=False))
    llm = make_llm(str(tiny_llama_dir), dtype="float32", max_model_len=160, multiprocess=False,
                   kv_transfer_config=offload_config(tmp_path, save_decode=True), **args)
    for _ in range(2):
        assert tokens(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert llm.get_stats().num_preemptions_total > 0
    assert tiers(llm)["CPU"].hits > 0


@pytest.mark.slow
def test_kv_events_carry_the_cpu_and_disk_medium(make_llm, tiny_llama_dir, tmp_path) -> None:
    from lm_console.engine.metrics.kv_events import BlockStored
    from lm_console.engine.metrics.kv_events import KVEventSubscriber

    llm = engine(make_llm, tiny_llama_dir, offload_config(tmp_path), multiprocess=True, enable_kv_cache_events=True)
    subscriber = KVEventSubscriber(llm.kv_events_endpoint)
    time.sleep(0.2)
    llm.generate(make_prompts(), GREEDY, use_tqdm=False)
    assert llm.engine_core.call_utility("flush_kv_connector", 30.0)
    llm.generate(make_prompts(2), GREEDY, use_tqdm=False)  # a later step publishes the disk writes
    stored: dict[str, set[bytes]] = {}
    while (message := subscriber.receive(0.5)) is not None:
        for event in message[1].events:
            if isinstance(event, BlockStored):
                stored.setdefault(event.medium, set()).update(event.block_hashes)
                if event.medium in ("CPU", "DISK"):
                    assert event.block_size == CHUNK and len(event.token_ids) == CHUNK
    subscriber.close()
    assert {"GPU", "CPU", "DISK"} <= set(stored)
    assert stored["CPU"] == {bytes.fromhex(p.name.removesuffix(".kvchunk")) for p in tmp_path.glob("*.kvchunk")}
    assert stored["DISK"] <= stored["CPU"] and len(stored["DISK"]) >= 6


@pytest.mark.parametrize("model_fixture", ["tiny_llama_d64_dir", "tiny_llama_dir"], ids=["int8-kernels", "int8-torch"])
def test_the_int8_cache_offloads_its_own_bytes_and_never_mixes_with_bf16(make_llm, model_fixture, request,
                                                                          tmp_path) -> None:
    """kv_cache_dtype="int8": chunks hold the int8 rows with their scales; outputs equal the same
    engine's without offload, after the prefix cache forgot and after a restart from disk; a
    bf16 engine on the same disk tier finds none of them (the chunk hashes name the cache's type)."""
    import torch

    model_dir = request.getfixturevalue(model_fixture)

    def build(config, kv_cache_dtype="int8"):
        return make_llm(str(model_dir), dtype="bfloat16", quantization="int8", kv_cache_dtype=kv_cache_dtype,
                        max_model_len=256, multiprocess=False, kv_transfer_config=config)

    expected = tokens(build(None).generate(make_prompts(), GREEDY, use_tqdm=False))
    first = build(offload_config(tmp_path))
    assert tokens(first.generate(make_prompts(), GREEDY, use_tqdm=False)) == expected
    chunk = next(iter(connector_of(first).store.cpu._chunks.values()))
    head_dim = first.engine_core.engine_core.model_executor.worker.model_runner.head_dim
    assert chunk.dtype == torch.int8 and chunk.shape[-1] == head_dim + 4
    first.reset_prefix_cache()
    outputs = first.generate(make_prompts(), GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected and [o.num_cached_tokens for o in outputs] == EXPECTED_HITS
    first.shutdown()  # joins the disk writer
    restarted = build(offload_config(tmp_path))
    outputs = restarted.generate(make_prompts(), GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected and [o.num_cached_tokens for o in outputs] == EXPECTED_HITS
    assert tiers(restarted)["DISK"].hits == 6
    other = build(offload_config(tmp_path), kv_cache_dtype="bfloat16")
    outputs = other.generate(make_prompts(), GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 0] and tiers(other)["DISK"].errors == 0
