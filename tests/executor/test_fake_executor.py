"""FakeExecutor: reproducible tokens whatever the batching, under the real EngineCore and Scheduler."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from lm_console.engine.core.engine_core import EngineCore
from lm_console.engine.errors import EngineDeadError, InsufficientKVCacheError, InvalidEngineArgsError
from lm_console.engine.executor import fake as fake_module
from lm_console.engine.executor.fake import FakeModelConfig, fake_engine_config, fake_token_id, request_key
from lm_console.engine.metrics.kv_events import BlockRemoved, BlockStored
from lm_console.engine.protocol import EngineCoreRequest, FinishReason
from lm_console.engine.sampling_params import SamplingParams

VOCAB = 1000


def make_core(**kwargs) -> EngineCore:  # noqa: ANN003
    model = kwargs.pop("model", FakeModelConfig(vocab_size=VOCAB, max_position_embeddings=256))
    kwargs.setdefault("num_blocks", 64)
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("max_model_len", 128)
    return EngineCore(fake_engine_config(model, **kwargs))


def request(request_id: str, prompt: list[int], max_tokens: int = 8, seed: int | None = None,
            **params) -> EngineCoreRequest:  # noqa: ANN003
    return EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, seed=seed, **params),
                             eos_token_id=None, arrival_time=0.0)


@dataclass
class Run:
    """What run_all() saw: tokens and finish reasons per request, stats and KV events per step."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, FinishReason] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    stats: list = field(default_factory=list)
    events: list = field(default_factory=list)
    first_token_step: dict[str, int] = field(default_factory=dict)


def run_all(core: EngineCore, run: Run | None = None, max_steps: int = 5000) -> Run:
    run = run or Run()
    for step in range(max_steps):
        if not core.has_unfinished_requests():
            return run
        outputs, _ = core.step()
        for client_outputs in outputs.values():
            if client_outputs.scheduler_stats is not None:
                run.stats.append(client_outputs.scheduler_stats)
            if client_outputs.kv_events is not None:
                run.events += client_outputs.kv_events.events
            for output in client_outputs.outputs:
                run.tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                run.first_token_step.setdefault(output.request_id, step)
                run.cached[output.request_id] = output.num_cached_tokens
                if output.finish_reason is not None:
                    run.finish[output.request_id] = output.finish_reason
    raise AssertionError("the engine did not finish")


def prompts(n: int, length: int = 10) -> list[list[int]]:
    return [[(i * 37 + j * 11) % VOCAB for j in range(length + i)] for i in range(n)]


def assert_no_leak(core: EngineCore) -> None:
    state = core.get_block_pool_state()
    assert state.all_free, state
    # The worker hears of requests that finished in the last step with the next SchedulerOutput.
    assert set(core.model_executor.requests) <= core.scheduler.finished_req_ids


def test_the_engine_core_path_imports_no_torch() -> None:
    code = ("import sys\nfrom lm_console.engine.core.engine_core import EngineCore\n"
            "from lm_console.engine.executor.fake import FakeExecutor, fake_engine_config\n"
            "core = EngineCore(fake_engine_config())\n"
            "from lm_console.engine.protocol import EngineCoreRequest\n"
            "from lm_console.engine.sampling_params import SamplingParams\n"
            "core.add_request(EngineCoreRequest('r', [1, 2, 3], SamplingParams(max_tokens=3), None, 0.0))\n"
            "while core.has_unfinished_requests():\n    core.step()\n"
            "print(','.join(m for m in ('torch', 'transformers', 'triton', 'numpy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_tokens_are_a_function_of_the_request_and_position() -> None:
    core = make_core()
    for i, prompt in enumerate(prompts(3)):
        core.add_request(request(f"r{i}", prompt))
    core.add_request(request("seeded", prompts(1)[0], seed=7))
    run = run_all(core)
    for i, prompt in enumerate(prompts(3)):
        key = request_key(0, None, prompt)
        expected = [fake_token_id(key, len(prompt) + k, VOCAB) for k in range(8)]
        assert run.tokens[f"r{i}"] == expected and run.finish[f"r{i}"] == FinishReason.LENGTH
    assert run.tokens["seeded"] != run.tokens["r0"]  # a seed picks another sequence
    again = make_core()
    again.add_request(request("other-id", prompts(1)[0], seed=7))
    assert run_all(again).tokens["other-id"] == run.tokens["seeded"]  # reproducible, whatever the id
    reseeded = make_core(seed=1)
    reseeded.add_request(request("r0", prompts(1)[0]))
    assert run_all(reseeded).tokens["r0"] != run.tokens["r0"]  # the engine's seed takes part
    assert_no_leak(core)


def test_outputs_do_not_depend_on_batching_chunking_or_preemption() -> None:
    batch = prompts(12, length=20)
    alone = {}
    for i, prompt in enumerate(batch):
        core = make_core(num_blocks=200, max_num_batched_tokens=256)
        core.add_request(request(f"r{i}", prompt, max_tokens=12))
        alone.update(run_all(core).tokens)
    # All at once, through a 16-token budget (chunked prefill) and a pool too small for the batch.
    crowded = make_core(num_blocks=40, max_num_batched_tokens=16)
    for i, prompt in enumerate(batch):
        crowded.add_request(request(f"r{i}", prompt, max_tokens=12))
    run = run_all(crowded)
    assert sum(s.num_preempted_reqs for s in run.stats) > 0  # the small pool did preempt
    assert run.tokens == alone
    assert_no_leak(crowded)


def test_chunked_prefill_samples_only_after_the_whole_prompt() -> None:
    core = make_core(max_num_batched_tokens=8)
    core.add_request(request("long", list(range(30)), max_tokens=3))
    run = run_all(core)
    assert run.first_token_step["long"] == 3  # 30 prompt tokens at 8 a step: steps 0-3
    assert [s.num_scheduled_tokens for s in run.stats[:4]] == [8, 8, 8, 6]
    assert [s.num_prompt_tokens for s in run.stats[:4]] == [8, 8, 8, 6]
    assert len(run.tokens["long"]) == 3


def test_prefix_cache_hits_and_kv_events() -> None:
    core = make_core(enable_kv_cache_events=True)
    shared = list(range(100, 116))  # four full blocks of 4
    core.add_request(request("a", shared + [1, 2, 3]))
    first = run_all(core)
    core.add_request(request("b", shared + [4, 5, 6]))
    second = run_all(core)
    assert first.cached["a"] == 0 and second.cached["b"] == 16
    assert sum(s.prefix_cache.hits for s in second.stats) == 16
    stored = [e for e in first.events if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) >= 4 and stored[0].parent_block_hash is None
    assert stored[0].token_ids[:4] == shared[:4]
    assert set(core.get_prefix_cache_hashes()) >= {h for e in stored for h in e.block_hashes}
    assert_no_leak(core)


def test_tiny_pool_preempts_evicts_and_finishes_everything() -> None:
    core = make_core(num_blocks=12, max_model_len=40, enable_kv_cache_events=True, max_num_batched_tokens=64)
    for i in range(6):
        core.add_request(request(f"r{i}", [i * 100 + j for j in range(8)], max_tokens=12))
    run = run_all(core)
    assert run.stats[-1].num_preemptions_total > 0
    assert sorted(run.finish) == [f"r{i}" for i in range(6)]
    assert all(len(tokens) == 12 for tokens in run.tokens.values())
    assert any(isinstance(e, BlockRemoved) for e in run.events)  # cached blocks evicted for reuse
    assert_no_leak(core)


def test_abort_mid_flight_leaks_nothing() -> None:
    core = make_core()
    for i, prompt in enumerate(prompts(4, length=30)):
        core.add_request(request(f"r{i}", prompt, max_tokens=50))
    for _ in range(3):
        core.step()
    core.abort_requests(["r0", "r2", "nobody"])
    run = run_all(core)
    assert sorted(run.finish) == ["r1", "r3"]
    assert_no_leak(core)
    core.add_request(request("r0", prompts(1, length=30)[0], max_tokens=4))  # the id is free again
    assert len(run_all(core).tokens["r0"]) == 4


def test_step_time_is_reported_and_slept_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(fake_module.time, "sleep", slept.append)
    quiet = make_core(model=FakeModelConfig(vocab_size=VOCAB, max_position_embeddings=256, step_time_s=0.01,
                                            step_time_per_token_s=0.001, sleep=False))
    quiet.add_request(request("r", list(range(10)), max_tokens=2))
    quiet.step()
    assert quiet.model_executor.last_step_time_s == pytest.approx(0.01 + 10 * 0.001) and slept == []
    sleepy = make_core(model=FakeModelConfig(vocab_size=VOCAB, max_position_embeddings=256, step_time_s=0.02))
    sleepy.add_request(request("r", list(range(10)), max_tokens=2))
    run_all(sleepy)
    assert slept == [0.02, 0.02]  # the prefill step and one decode step


def test_logprobs_are_the_sampled_token_with_certainty() -> None:
    core = make_core()
    core.add_request(request("r", list(range(10)), max_tokens=2, logprobs=3))
    outputs, _ = core.step()
    (output,) = outputs[0].outputs
    logprobs = output.new_logprobs
    assert logprobs is not None and logprobs.sampled_token_ranks == [1]
    assert logprobs.logprob_token_ids[0][:2] == output.new_token_ids * 2 and len(logprobs.logprob_token_ids[0]) == 4
    assert logprobs.logprobs[0][:2] == [0.0, 0.0]


def test_refusals() -> None:
    with pytest.raises(InsufficientKVCacheError, match="usable blocks"):  # 128 tokens need 32 blocks + null
        make_core(num_blocks=32)
    with pytest.raises(InvalidEngineArgsError, match="power of two"):
        fake_engine_config(block_size=12)
    with pytest.raises(InvalidEngineArgsError, match="max_position_embeddings"):
        fake_engine_config(FakeModelConfig(max_position_embeddings=128), max_model_len=512)
    core = make_core(num_blocks=None, kv_cache_memory=1 << 20)  # sized from the memory budget
    executor = core.model_executor
    assert core.kv_cache_config.num_blocks == (1 << 20) // executor.get_kv_cache_block_bytes()
    assert executor.collective_rpc("get_kv_cache_block_bytes") == [2 * 2 * 4 * 4 * 32 * 2]
    with pytest.raises(AttributeError, match="no method 'load_model'"):
        executor.collective_rpc("load_model")
    core.shutdown()
    with pytest.raises(EngineDeadError):
        executor.check_health()
