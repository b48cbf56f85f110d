"""LoRA through the engine: admission errors, no block shared across adapters (KV events carry
the adapter), the scheduler's max_loras limit and the host-memory LRU, and the default
quantized CPU path (the base stays quantized, the C decode stack is routed around)."""

from __future__ import annotations

import pytest

from lm_console.engine import LLM, SamplingParams
from lm_console.engine.errors import InvalidLoRARequestError
from lm_console.engine.lora import LoRARequest
from lm_console.engine.metrics.kv_events import BlockStored
from llm_helpers import random_prompts
from lora_helpers import write_adapter

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_llm(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
              enable_kv_cache_events=True, multiprocess=False, enable_lora=True, max_loras=2, max_lora_rank=8)
    stored: list[BlockStored] = []
    get_output = llm.engine_core.get_output

    def recording_get_output():  # type: ignore[no-untyped-def]
        outputs = get_output()
        if outputs.kv_events is not None:
            stored.extend(e for e in outputs.kv_events.events if isinstance(e, BlockStored))
        return outputs

    llm.engine_core.get_output = recording_get_output  # type: ignore[method-assign]
    yield llm, stored
    llm.shutdown()


def test_two_adapters_never_share_a_block_and_events_name_the_adapter(lora_llm, tiny_llama_adapters) -> None:
    llm, stored = lora_llm
    tokens = list(range(300, 300 + 3 * BLOCK_SIZE + 5))  # 3 full blocks
    a = LoRARequest("all-r8", 1, str(tiny_llama_adapters["all-r8"]))
    b = LoRARequest("all-r8-a32", 2, str(tiny_llama_adapters["all-r8-a32"]))

    def run(lora):  # noqa: ANN001, ANN202
        stored.clear()
        (out,) = llm.generate([{"prompt_token_ids": tokens}], GREEDY, use_tqdm=False, lora_request=lora)
        return out, list(stored)

    out_a, events_a = run(a)
    out_b, events_b = run(b)
    out_base, events_base = run(None)
    assert out_a.num_cached_tokens == out_b.num_cached_tokens == out_base.num_cached_tokens == 0
    hashes = [{h for e in events for h in e.block_hashes} for events in (events_a, events_b, events_base)]
    assert all(len(h) >= 3 for h in hashes)
    assert not hashes[0] & hashes[1] and not hashes[2] & (hashes[0] | hashes[1]), "a block shared across adapters"
    assert {(e.lora_id, e.lora_name) for e in events_a} == {(1, "all-r8")}
    assert {(e.lora_id, e.lora_name) for e in events_b} == {(2, "all-r8-a32")}
    assert {(e.lora_id, e.lora_name) for e in events_base} == {(None, None)}
    again, events_again = run(a)  # the same adapter hits its own blocks
    assert again.num_cached_tokens == 3 * BLOCK_SIZE and again.outputs[0].token_ids == out_a.outputs[0].token_ids
    assert events_again == [] or all(e.lora_id == 1 for e in events_again)
    assert len({tuple(o.outputs[0].token_ids) for o in (out_a, out_b, out_base)}) == 3


def test_negative_control_without_the_adapter_in_the_hash_blocks_are_shared(tiny_llama_dir, tiny_llama_adapters,
                                                                            monkeypatch) -> None:
    """The check above fails when the block hash leaves the adapter out: the second adapter's
    request then hits the first one's blocks."""
    from lm_console.engine import kv_cache_hashing

    real = kv_cache_hashing.generate_block_hash_extra_keys

    def no_lora(request, *args):  # noqa: ANN001, ANN202
        class View:
            all_token_ids, block_hashes = request.all_token_ids, request.block_hashes
            cache_salt, mm_features, lora_request = request.cache_salt, request.mm_features, None
        return real(View(), *args)

    monkeypatch.setattr(kv_cache_hashing, "generate_block_hash_extra_keys", no_lora)
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
              multiprocess=False, enable_lora=True, max_loras=2, max_lora_rank=8)
    try:
        tokens = list(range(300, 300 + 3 * BLOCK_SIZE + 5))
        for i, name in enumerate(("all-r8", "all-r8-a32"), start=1):
            (out,) = llm.generate([{"prompt_token_ids": tokens}], GREEDY, use_tqdm=False,
                                  lora_request=LoRARequest(name, i, str(tiny_llama_adapters[name])))
    finally:
        llm.shutdown()
    assert out.num_cached_tokens == 3 * BLOCK_SIZE  # the second adapter reused the first's KV


def test_admission_refuses_bad_lora_requests(lora_llm, tiny_llama_adapters, tmp_path) -> None:
    llm, _ = lora_llm
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    big = write_adapter(tmp_path / "r16", rank=16)
    other = write_adapter(tmp_path / "wide", rank=4, dims={"q_proj": (96, 64), "v_proj": (96, 32)})
    cases = [
        (LoRARequest("nope", 7, str(tmp_path / "missing")), "not a directory"),
        (LoRARequest("big", 8, str(big)), "exceeds max_lora_rank=8"),
        (LoRARequest("wide", 9, str(other)), "trained for another base model"),
        (LoRARequest("all-r8", 1, str(tiny_llama_adapters["all-r8"])), None),  # id 1 first: fine
        (LoRARequest("clash", 1, str(tiny_llama_adapters["mlp-qv-r4-rs"])), "already names adapter"),
        (LoRARequest("renamed", 1, str(tiny_llama_adapters["all-r8"])), "already names adapter"),
        ("all-r8", "must be a LoRARequest"),
    ]
    for lora, match in cases:
        if match is None:
            llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)
            continue
        with pytest.raises(InvalidLoRARequestError, match=match):
            llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)
    with pytest.raises(InvalidLoRARequestError, match="one \\(or None\\) per prompt"):
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=[None, None])


def test_a_lora_request_without_enable_lora_is_refused(make_llm, tiny_llama_dir, tiny_llama_adapters) -> None:
    llm = make_llm(str(tiny_llama_dir), dtype="float32", multiprocess=False, num_gpu_blocks_override=32,
                   max_model_len=256)
    with pytest.raises(InvalidLoRARequestError, match="LoRA is not enabled.*--enable-lora"):
        llm.generate([{"prompt_token_ids": [5, 6]}], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("a", 1, str(tiny_llama_adapters["all-r8"])))


def test_max_loras_limits_the_adapters_per_step_and_the_lru_reloads(tiny_llama_dir, tiny_llama_adapters,
                                                                    monkeypatch) -> None:
    """max_loras=1, max_cpu_loras=1 and three adapters in one batch: no step runs two adapters,
    adapters are read from their files again after eviction, and every output equals the one
    the adapter gives alone."""
    from lm_console.engine.worker.lora_manager import LoRAManager
    from transformers import AutoConfig

    names = ["all-r8", "attn-r16", "mlp-qv-r4-rs"]
    loras = [LoRARequest(n, i + 1, str(tiny_llama_adapters[n])) for i, n in enumerate(names)]
    vocab = AutoConfig.from_pretrained(tiny_llama_dir).vocab_size
    prompts = random_prompts(vocab, 9, 5, 40, seed=41)
    assignment = [loras[i % 3] if i % 4 else None for i in range(9)]
    per_step: list[int] = []
    real = LoRAManager.slots_for

    def recording(self, requests):  # noqa: ANN001, ANN202
        per_step.append(len({r.lora_int_id for r in requests if r is not None}))
        return real(self, requests)

    monkeypatch.setattr(LoRAManager, "slots_for", recording)
    args = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, multiprocess=False,
                enable_lora=True, max_lora_rank=16)
    llm = LLM(str(tiny_llama_dir), max_loras=1, max_cpu_loras=1, **args)
    try:
        mixed = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                             lora_request=assignment)
        manager = llm.engine_core.engine_core.model_executor.worker.model_runner.lora_manager
        loads = manager.num_loads
    finally:
        llm.shutdown()
    assert per_step and max(per_step) == 1
    assert loads >= 3
    alone = LLM(str(tiny_llama_dir), max_loras=3, **args)
    try:
        for i, (prompt, lora) in enumerate(zip(prompts, assignment)):
            (out,) = alone.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=lora)
            assert out.outputs[0].token_ids == mixed[i].outputs[0].token_ids, i
    finally:
        alone.shutdown()


def test_the_core_reports_each_requests_adapter_to_the_console(lora_llm, tiny_llama_adapters) -> None:
    llm, _ = lora_llm
    lora = LoRARequest("all-r8", 1, str(tiny_llama_adapters["all-r8"]))
    children = llm.input_processor.process_request("console-row", {"prompt_token_ids": [5, 6, 7]}, GREEDY,
                                                   lora_request=lora)
    plain = llm.input_processor.process_request("console-plain", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    llm.engine_core.add_requests([c[1] for c in children + plain])
    try:
        rows = {r.request_id: r for r in llm.get_request_blocks().requests}
        assert rows["console-row"].lora_name == "all-r8" and rows["console-plain"].lora_name is None
    finally:
        llm.engine_core.abort_requests(["console-row", "console-plain"])


def test_lmc_generate_with_lora(tiny_llama_dir, tiny_llama_adapters, tmp_path) -> None:
    """`lmc generate --lora NAME=PATH` runs the prompt with the adapter: its text is the one
    LLM.generate gives with that adapter (and not the base model's); a bad spec is refused."""
    from typer.testing import CliRunner

    from lm_console.cli import app

    runner = CliRunner()
    path = tiny_llama_adapters["all-r8"]
    args = ["generate", "Hello there", "--model", str(tiny_llama_dir), "--max-tokens", "6", "--dtype", "float32"]
    tuned = runner.invoke(app, [*args, "--lora", f"tuned={path}"])
    base = runner.invoke(app, args)
    assert tuned.exit_code == 0 and base.exit_code == 0, tuned.output + base.output
    llm = LLM(str(tiny_llama_dir), dtype="float32", multiprocess=False, enable_lora=True)
    try:
        (out,) = llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False,
                              lora_request=LoRARequest("tuned", 1, str(path)))
    finally:
        llm.shutdown()
    assert tuned.stdout.strip() == out.outputs[0].text.strip() != base.stdout.strip()
    bad = runner.invoke(app, [*args, "--lora", str(path)])
    assert bad.exit_code == 2 and "NAME=PATH" in bad.output
