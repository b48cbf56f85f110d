"""MultiprocExecutor and tensor parallelism end to end: TP=2 over worker processes gives the
greedy tokens of TP=1; a worker's SIGKILL is an EngineDeadError in every caller, with no orphan
process and no shared-memory segment left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from lm_console.engine import LLM, AsyncLLM, EngineArgs, SamplingParams
from lm_console.engine.errors import EngineDeadError, InvalidEngineArgsError
from lm_console.engine.worker.rpc_protocol import method_name
from broken_variants import rank1_attention_zeroed
from llm_helpers import assert_all_equal, assert_no_leaked_blocks, text_prompts

pytestmark = pytest.mark.slow

ENGINE_ARGS = dict(dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=256)
MAX_TOKENS = 12


def _shm() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("psm_")}


def _prompts(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    return text_prompts(AutoTokenizer.from_pretrained(str(model_dir)), 4, 5, 40)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)


def _reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """TP=1: one worker in-process, the engine core in this process too."""
    llm = LLM(str(model_dir), multiprocess=False, **ENGINE_ARGS)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.shutdown()


def _workers(core_pid: int) -> list[psutil.Process]:
    """The worker processes under the engine core (children of its forkserver, or spawned)."""
    descendants = psutil.Process(core_pid).children(recursive=True)
    return [p for p in descendants
            if p.ppid() != core_pid or "spawn_main" in " ".join(p.cmdline())]


def _tree(core_pid: int) -> list[psutil.Process]:
    return [psutil.Process(core_pid), *psutil.Process(core_pid).children(recursive=True)]


def _assert_all_gone(procs: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(procs, timeout=30)
    assert not alive, f"orphan processes left: {alive}"


def test_refusals_without_an_engine(tiny_llama_dir: Path) -> None:
    with pytest.raises(InvalidEngineArgsError, match="tensor_parallel_size=3 does not divide.*num_attention_heads=4"):
        EngineArgs(model=str(tiny_llama_dir), tensor_parallel_size=3, device="cpu").create_engine_config()
    with pytest.raises(TypeError, match="cannot be sent without pickle"):
        method_name(lambda worker: worker)
    assert method_name(_shm) == f"{__name__}:_shm"


@pytest.fixture
def llama_tp2(tiny_llama_dir: Path):
    """A TP=2 engine of its own: the test ends by killing a worker, so no other test may share it
    (pytest-randomly reorders a module's tests)."""
    shm_before = _shm()
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **ENGINE_ARGS)
    yield llm, shm_before
    llm.shutdown()


def test_tp2_equals_tp1_on_llama_no_block_leaks_then_worker_sigkill_is_engine_dead(
        llama_tp2, tiny_llama_dir: Path) -> None:
    llm, shm_before = llama_tp2
    assert llm.config.parallel_config.distributed_executor_backend == "mp"  # tp > 1 switched uni to mp
    prompts = _prompts(tiny_llama_dir)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
    assert_all_equal([o.outputs[0].token_ids for o in outputs], _reference(tiny_llama_dir, prompts), "TP=2 vs TP=1")
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) > 1  # not a degenerate model
    assert_no_leaked_blocks(llm)
    _sigkill_of_worker_1_is_engine_dead(llm, shm_before)


def _sigkill_of_worker_1_is_engine_dead(llm: LLM, shm_before: set[str]) -> None:
    """SIGKILL rank 1 mid-generation: the caller gets EngineDeadError, so does every later call,
    and shutdown leaves no process and no shared-memory name behind."""
    core_pid = llm.engine_core.ready_info.pid
    workers = _workers(core_pid)
    assert len(workers) == 2
    tree = _tree(core_pid)
    assert not (_shm() - shm_before)  # the queues' names are unlinked once every reader attached
    errors: list[BaseException] = []
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    def caller() -> None:
        try:
            llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, long, use_tqdm=False)
        except BaseException as error:  # noqa: BLE001 - the test inspects it
            errors.append(error)

    thread = threading.Thread(target=caller)
    thread.start()
    time.sleep(0.5)  # let the generation start (the test holds whatever the timing)
    killed_at = time.monotonic()
    os.kill(workers[1].pid, signal.SIGKILL)
    thread.join(60)
    print(f"LLM caller: EngineDeadError {time.monotonic() - killed_at:.2f} s after SIGKILL")
    assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors
    assert "worker rank 1" in str(errors[0])
    with pytest.raises(EngineDeadError):  # and every later call
        llm.generate("hello", use_tqdm=False)
    llm.shutdown()
    _assert_all_gone(tree)
    assert not (_shm() - shm_before)


def test_negative_control_rank1_attention_zeroed_fails_the_tp_check(tiny_llama_dir: Path) -> None:
    """The TP check (assert_all_equal against TP=1) on the output of an engine whose rank-1 heads
    lost their attention (tests/broken_variants.py, emulated in-process) must fail."""
    prompts = _prompts(tiny_llama_dir)
    reference = _reference(tiny_llama_dir, prompts)
    with rank1_attention_zeroed():
        broken = _reference(tiny_llama_dir, prompts)
    with pytest.raises(AssertionError, match="exactly equal"):
        assert_all_equal(broken, reference, "TP=2 vs TP=1")


@pytest.fixture(scope="module")
def qwen3_async(tiny_qwen3_dir: Path):
    engine = AsyncLLM(str(tiny_qwen3_dir), tensor_parallel_size=2, stat_loggers=[], **ENGINE_ARGS)
    yield engine
    engine.shutdown()


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


def test_tp2_equals_tp1_on_qwen3_async_and_sigkill_is_engine_dead(qwen3_async, tiny_qwen3_dir: Path) -> None:
    engine = qwen3_async
    prompts = _prompts(tiny_qwen3_dir)

    async def generate_all() -> list[list[int]]:
        async def one(i: int, prompt: list[int]) -> list[int]:
            final = None
            async for out in engine.generate({"prompt_token_ids": prompt}, _greedy(), f"r{i}"):
                final = out
            return final.outputs[0].token_ids

        tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        assert_no_leaked_blocks(await engine.get_block_pool_state())
        return list(tokens)

    assert_all_equal(_run(generate_all()), _reference(tiny_qwen3_dir, prompts), "TP=2 async vs TP=1")

    core_pid = engine.engine_core.ready_info.pid
    tree, workers = _tree(core_pid), _workers(core_pid)

    async def killed_mid_stream() -> float:
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        stream = engine.generate({"prompt_token_ids": [5, 6, 7]}, long, "victim")
        await stream.__anext__()  # the request is running
        killed_at = time.monotonic()
        os.kill(workers[0].pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="worker rank 0"):
            async for _ in stream:
                pass
        return time.monotonic() - killed_at

    print(f"AsyncLLM caller: EngineDeadError {_run(killed_mid_stream()):.2f} s after SIGKILL")
    engine.shutdown()
    _assert_all_gone(tree)


@pytest.mark.slow
def test_tp2_equals_tp1_on_gemma3_and_core_sigkill_takes_the_workers(tiny_gemma3_dir: Path) -> None:
    prompts = _prompts(tiny_gemma3_dir)
    shm_before = _shm()
    llm = LLM(str(tiny_gemma3_dir), tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
        assert_no_leaked_blocks(llm)
        core_pid = llm.engine_core.ready_info.pid
        tree = _tree(core_pid)
        assert len(_workers(core_pid)) == 2
        os.kill(core_pid, signal.SIGKILL)  # the workers' death pipe closes with it
        with pytest.raises(EngineDeadError):
            llm.generate("hello", use_tqdm=False)
        _assert_all_gone(tree)
    finally:
        llm.shutdown()
    assert not (_shm() - shm_before)
    assert_all_equal([o.outputs[0].token_ids for o in outputs], _reference(tiny_gemma3_dir, prompts), "TP=2 vs TP=1")


def _rank_and_threads(worker) -> tuple[int, int]:
    import torch

    return worker.rank, torch.get_num_threads()


def _fail(worker) -> None:
    raise ValueError(f"rank {worker.rank} refuses")


def test_tp2_in_bf16_samples_from_each_ranks_own_head_rows(tiny_llama_dir: Path) -> None:
    """bf16 logits refine each row's contenders in fp32 from the head's weight rows: under TP each
    rank must do it on its own vocabulary slice before the one gather (it once gathered first
    and indexed its slice with full-vocabulary columns: IndexError)."""
    args = dict(ENGINE_ARGS, dtype="bfloat16")
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10 + i]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    outputs = {}
    for tp in (1, 2):
        llm = LLM(str(tiny_llama_dir), tensor_parallel_size=tp, **args)
        try:
            outputs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert_no_leaked_blocks(llm)
        finally:
            llm.shutdown()
    assert outputs[2] == outputs[1]


def test_executor_rpc_replies_and_non_blocking_sample_tokens(tiny_llama_dir: Path) -> None:
    from lm_console.engine.executor.abstract import Executor
    from lm_console.engine.executor.multiproc import MultiprocExecutor
    from lm_console.engine.kv_cache_interface import FullAttentionSpec
    from lm_console.engine.model_runner_output import ModelRunnerOutput
    from lm_console.engine.scheduler_output import CachedRequestData, SchedulerOutput

    config = EngineArgs(model=str(tiny_llama_dir), tensor_parallel_size=2, **ENGINE_ARGS).create_engine_config()
    shm_before = _shm()
    executor = Executor.get_class(config)(config)
    try:
        assert isinstance(executor, MultiprocExecutor)
        # A module-level function runs on every rank; each rank takes its share of the cores.
        # (Results travel as msgpack: a tuple comes back as a list.)
        from lm_console.engine.platform import usable_cpus

        threads = max(1, usable_cpus() // 2)  # the CPUs this process may use, not the machine's
        assert executor.collective_rpc(_rank_and_threads) == [[0, threads], [1, threads]]
        assert executor.collective_rpc(_rank_and_threads, unique_reply_rank=1) == [[1, threads]]
        specs = executor.get_kv_cache_spec()
        assert len(specs) == 2 and set(specs.values()) == {FullAttentionSpec(block_size=16)}
        # Each rank's KV cache holds its half of the KV heads: half the bytes of a TP=1 block
        # (K and V x 2 layers x 16 tokens x 2 KV heads x head_dim 16 x 4 bytes).
        model = config.model_config
        assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 2, 16)
        assert executor.get_kv_cache_block_bytes() * 2 == 2 * 2 * 16 * 2 * 16 * 4
        with pytest.raises(RuntimeError, match="rank 0 refuses"):
            executor.collective_rpc(_fail)
        executor.initialize_kv_cache(32)
        empty = SchedulerOutput([], CachedRequestData(), {}, 0, set(), set())
        futures = []
        for _ in range(2):  # two steps in flight: the replies come back in order
            executor.execute_model(empty, non_block=True)
            futures.append(executor.sample_tokens(non_block=True))
        assert all(isinstance(f.result(timeout=60), ModelRunnerOutput) for f in reversed(futures))
        executor.check_health()
    finally:
        executor.shutdown()
    assert not (_shm() - shm_before)


def test_embedded_model_heads_refuse_tp2(embedded_model_dir: Path) -> None:
    # SmolLM2-135M has 9 query heads and 3 KV heads: TP=2 cannot split them, TP=3 can.
    with pytest.raises(InvalidEngineArgsError, match="tensor_parallel_size=2 does not divide.*=9"):
        EngineArgs(model=str(embedded_model_dir), tensor_parallel_size=2, device="cpu").create_engine_config()


@pytest.mark.slow
def test_tp3_equals_tp1_on_the_embedded_model(embedded_model_dir: Path) -> None:
    prompts = _prompts(embedded_model_dir)[:2]
    llm = LLM(str(embedded_model_dir), tensor_parallel_size=3, **ENGINE_ARGS)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
        assert_no_leaked_blocks(llm)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == _reference(embedded_model_dir, prompts)


def _start_a_child(worker) -> int:
    """Start a child process from the worker (as a library's process pool would); its exit code."""
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=int)
    child.start()
    child.join(60)
    return child.exitcode


def test_a_worker_may_start_child_processes(tiny_llama_dir: Path) -> None:
    """Worker processes start daemonic, which multiprocessing answers with "daemonic processes are
    not allowed to have children" to anything in them that starts a process."""
    from lm_console.engine.executor.abstract import Executor

    config = EngineArgs(model=str(tiny_llama_dir), tensor_parallel_size=2, **ENGINE_ARGS).create_engine_config()
    executor = Executor.get_class(config)(config)
    try:
        assert executor.collective_rpc(_start_a_child) == [0, 0]
    finally:
        executor.shutdown()


def test_tp3_worker_sigkill_leaves_no_engine_process_2s_after_the_error(tiny_llama_tp3_dir: Path) -> None:
    """Issue 38: the caller's EngineDeadError came fast, but an engine process (the core's worker
    forkserver, tearing down torch) outlived it by seconds. Now every one is gone within 2 s."""
    from llm_helpers import sigkill_during_generate

    llm = LLM(str(tiny_llama_tp3_dir), tensor_parallel_size=3, **ENGINE_ARGS)
    try:
        core_pid = llm.engine_core.ready_info.pid
        workers = _workers(core_pid)
        tree = _tree(core_pid)  # the core, its worker forkserver and the 3 workers
        assert len(workers) == 3
        error, _ = sigkill_during_generate(llm, lambda: llm.get_stats().num_running_reqs > 0, workers[1].pid)
        # The clock starts once the caller's thread has its error (it returns right after).
        _, alive = psutil.wait_procs(tree, timeout=2.0)
        assert isinstance(error, EngineDeadError) and "worker rank" in str(error)
        assert not alive, f"engine processes alive 2 s after the EngineDeadError: {alive}"
    finally:
        llm.shutdown()
